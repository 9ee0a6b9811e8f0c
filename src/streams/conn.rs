//! One way to reach Redis for the whole crate, whether it is a single node or a Redis
//! Cluster: [`RedisClient`] opens [`RedisConn`]s, and every caller (relay, replayers, `tail`,
//! reconcile, metrics, the shared provider budget, `serve`) runs its commands on a
//! `RedisConn` without knowing which one it is.
//!
//! - **Single node** (one URL): ordinary commands go through a self-reconnecting
//!   [`ConnectionManager`]; blocking reads get a dedicated [`MultiplexedConnection`].
//! - **Cluster** (several comma-separated URLs, or one seed URL with `redis_cluster`): a
//!   [`ClusterConnection`] (redis-rs `cluster-async`) keeps a connection per node, routes
//!   every command by the slot of its key (so `EVALSHA` goes where its `KEYS[1]` lives),
//!   follows `MOVED`/`ASK` redirections and refreshes the slot map after a failover, with
//!   the bounded retries set here. Our own loops retry whatever it still returns as
//!   transient (`is_transient_redis`).
//!
//! Blocking reads (`XREADGROUP`/`XREAD ... BLOCK`) never share a connection with anything
//! else, in either mode: redis-rs gives every reply a response timeout (500 ms by default),
//! which would cut a `BLOCK` short, and a `BLOCK` on a shared multiplexed pipe stalls every
//! other command queued behind it on that node. [`RedisClient::blocking`] opens a
//! connection of its own whose response timeout outlasts the block.

use std::time::Duration;

use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig, MultiplexedConnection};
use redis::cluster::{ClusterClient, ClusterClientBuilder, ClusterConfig};
use redis::cluster_async::ClusterConnection;
use redis::{AsyncConnectionConfig, Client, Cmd, Pipeline, RedisFuture, RedisResult, Value};

/// How long a connection attempt to one node may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long an ordinary command may wait for its reply.
const RESPONSE_TIMEOUT: Duration = Duration::from_secs(10);
/// How much longer than its `BLOCK` a blocking read may wait for its reply.
const BLOCK_MARGIN: Duration = Duration::from_secs(10);
/// Cluster: retries of one command after a redirection, a connection loss or a failover
/// (`TRYAGAIN`, `CLUSTERDOWN`, `READONLY`), each after a jittered wait of 100 ms growing to at
/// most 2 s: 5 to 8 s in all, longer than a replica's promotion with a `cluster-node-timeout`
/// of a few seconds. What still fails is retried by the caller's loop.
const CLUSTER_RETRIES: u32 = 10;
const CLUSTER_MIN_RETRY_WAIT_MS: u64 = 100;
const CLUSTER_MAX_RETRY_WAIT_MS: u64 = 2_000;
/// Cluster: the longest one command may take, retries included.
const CLUSTER_OVERALL_TIMEOUT: Duration = Duration::from_secs(20);
/// At most this many seed URLs in a cluster list (a typo must not open thousands of sockets).
pub const MAX_SEED_NODES: usize = 64;

/// Where Redis is: one node, or a cluster reached through its seed nodes. Cheap to clone.
#[derive(Clone)]
pub struct RedisClient {
    kind: Kind,
}

#[derive(Clone)]
enum Kind {
    Single(Client),
    Cluster(Vec<String>),
}

impl std::fmt::Debug for RedisClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the URLs: they may carry passwords.
        match &self.kind {
            Kind::Single(_) => f.write_str("RedisClient::Single"),
            Kind::Cluster(nodes) => write!(f, "RedisClient::Cluster({} seed nodes)", nodes.len()),
        }
    }
}

/// The URLs of a `redis_url` value: one URL, or several separated by commas (a cluster's
/// seed nodes). Blank items are ignored.
pub fn split_urls(urls: &str) -> Vec<&str> {
    urls.split(',').map(str::trim).filter(|u| !u.is_empty()).collect()
}

impl RedisClient {
    /// A client for `urls`: cluster mode when it lists several comma-separated node URLs or
    /// when `cluster` is set (one seed node is enough then: the others are discovered); a
    /// single node otherwise. Only parses: nothing is connected yet.
    pub fn open(urls: &str, cluster: bool) -> RedisResult<RedisClient> {
        let nodes = split_urls(urls);
        if nodes.is_empty() {
            return Err((redis::ErrorKind::InvalidClientConfig, "no Redis URL").into());
        }
        if nodes.len() > MAX_SEED_NODES {
            return Err(
                (redis::ErrorKind::InvalidClientConfig, "too many Redis seed URLs (at most 64)").into()
            );
        }
        if nodes.len() == 1 && !cluster {
            return Ok(RedisClient { kind: Kind::Single(Client::open(nodes[0])?) });
        }
        let nodes: Vec<String> = nodes.into_iter().map(str::to_string).collect();
        // Parse once here, so a bad URL is an error now and not at the first connection.
        cluster_builder(&nodes, RESPONSE_TIMEOUT, CLUSTER_OVERALL_TIMEOUT).build()?;
        Ok(RedisClient { kind: Kind::Cluster(nodes) })
    }

    /// Whether this client talks to a Redis Cluster.
    pub fn is_cluster(&self) -> bool {
        matches!(self.kind, Kind::Cluster(_))
    }

    /// A connection for ordinary (non-blocking) commands, shared by cloning: a
    /// self-reconnecting manager on a single node, a slot-routing connection on a cluster.
    pub async fn managed(&self) -> RedisResult<RedisConn> {
        match &self.kind {
            Kind::Single(client) => {
                let config = ConnectionManagerConfig::new()
                    .set_connection_timeout(Some(CONNECT_TIMEOUT))
                    .set_response_timeout(Some(RESPONSE_TIMEOUT))
                    .set_number_of_retries(2);
                Ok(RedisConn(Inner::Manager(client.get_connection_manager_with_config(config).await?)))
            }
            Kind::Cluster(nodes) => {
                let client = cluster_builder(nodes, RESPONSE_TIMEOUT, CLUSTER_OVERALL_TIMEOUT).build()?;
                Ok(RedisConn(Inner::Cluster(cluster_connection(&client, RESPONSE_TIMEOUT).await?)))
            }
        }
    }

    /// A connection of its own for blocking reads (`XREAD(GROUP) ... BLOCK block`), whose
    /// response timeout outlasts the block; see the module doc for why it is never shared.
    pub async fn blocking(&self, block: Duration) -> RedisResult<RedisConn> {
        let timeout = block + BLOCK_MARGIN;
        match &self.kind {
            Kind::Single(client) => {
                let config = AsyncConnectionConfig::new()
                    .set_connection_timeout(Some(CONNECT_TIMEOUT))
                    .set_response_timeout(Some(timeout));
                Ok(RedisConn(Inner::Multiplexed(
                    client.get_multiplexed_async_connection_with_config(&config).await?,
                )))
            }
            Kind::Cluster(nodes) => {
                let client = cluster_builder(nodes, timeout, timeout + CLUSTER_OVERALL_TIMEOUT).build()?;
                Ok(RedisConn(Inner::Cluster(cluster_connection(&client, timeout).await?)))
            }
        }
    }
}

fn cluster_builder(nodes: &[String], response: Duration, overall: Duration) -> ClusterClientBuilder {
    ClusterClientBuilder::new(nodes.iter().map(String::as_str))
        .connection_timeout(CONNECT_TIMEOUT)
        .response_timeout(response)
        .overall_response_timeout(Some(overall))
        .retries(CLUSTER_RETRIES)
        .min_retry_wait(CLUSTER_MIN_RETRY_WAIT_MS)
        .max_retry_wait(CLUSTER_MAX_RETRY_WAIT_MS)
}

async fn cluster_connection(client: &ClusterClient, response: Duration) -> RedisResult<ClusterConnection> {
    let config = ClusterConfig::new().set_connection_timeout(CONNECT_TIMEOUT).set_response_timeout(response);
    client.get_async_connection_with_config(config).await
}

/// A connection to Redis, single node or cluster; run commands on it like on any redis-rs
/// async connection (it implements [`ConnectionLike`]). Clones share the underlying
/// connection (a blocking one is meant for one task at a time).
#[derive(Clone)]
pub struct RedisConn(Inner);

#[derive(Clone)]
enum Inner {
    Manager(ConnectionManager),
    Multiplexed(MultiplexedConnection),
    Cluster(ClusterConnection),
}

impl RedisConn {
    /// Whether commands on this connection are routed over a cluster.
    pub fn is_cluster(&self) -> bool {
        matches!(self.0, Inner::Cluster(_))
    }
}

impl std::fmt::Debug for RedisConn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self.0 {
            Inner::Manager(_) => "RedisConn::Manager",
            Inner::Multiplexed(_) => "RedisConn::Multiplexed",
            Inner::Cluster(_) => "RedisConn::Cluster",
        })
    }
}

impl ConnectionLike for RedisConn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match &mut self.0 {
            Inner::Manager(c) => c.req_packed_command(cmd),
            Inner::Multiplexed(c) => c.req_packed_command(cmd),
            Inner::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match &mut self.0 {
            Inner::Manager(c) => c.req_packed_commands(pipeline, offset, count),
            Inner::Multiplexed(c) => c.req_packed_commands(pipeline, offset, count),
            Inner::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match &self.0 {
            Inner::Manager(c) => c.get_db(),
            Inner::Multiplexed(c) => c.get_db(),
            Inner::Cluster(c) => c.get_db(),
        }
    }
}

/// Classifies a Redis error for the background loops: by redis-rs kind and server error code.
/// Transient: I/O (connection refused, dropped, timed out), a server loading its data set,
/// cluster redirections and failovers (`TRYAGAIN`, `CLUSTERDOWN`, `MASTERDOWN`, `READONLY`,
/// `MOVED`, `ASK`), a busy script (`BUSY`), memory or persistence trouble (`OOM`, `MISCONF`),
/// missing replicas (`NOREPLICAS`) and a consumer group that vanished with its stream
/// (`NOGROUP`, `UNBLOCKED` for a read that was blocked when the stream was deleted, and `ERR
/// no such key` from `XINFO` on it: the replayer recreates the group). Permanent: everything else, e.g. `WRONGTYPE`, a
/// script error, `NOPERM`, failed authentication, a reply of an unexpected type.
pub(crate) fn is_transient_redis(e: &redis::RedisError) -> bool {
    use redis::{ErrorKind, ServerErrorKind};
    if e.is_io_error()
        || e.is_timeout()
        || e.is_connection_dropped()
        || e.is_connection_refusal()
        || is_lost_group(e)
    {
        return true;
    }
    match e.kind() {
        ErrorKind::Parse
        | ErrorKind::ClusterConnectionNotFound
        | ErrorKind::MasterNameNotFoundBySentinel
        | ErrorKind::NoValidReplicasFoundBySentinel => true,
        ErrorKind::Server(kind) => matches!(
            kind,
            ServerErrorKind::BusyLoading
                | ServerErrorKind::TryAgain
                | ServerErrorKind::ClusterDown
                | ServerErrorKind::MasterDown
                | ServerErrorKind::ReadOnly
                | ServerErrorKind::Moved
                | ServerErrorKind::Ask
        ),
        ErrorKind::Extension => {
            matches!(
                e.code(),
                Some("BUSY" | "OOM" | "MISCONF" | "NOREPLICAS" | "NOGROUP" | "UNBLOCKED" | "LOADING")
            )
        }
        _ => false,
    }
}

/// Whether `e` says the stream a group read was reading is gone with its consumer group
/// (`NOGROUP`; `UNBLOCKED` when the read was blocked as the stream was deleted, e.g. by a
/// `FLUSHALL`; `ERR no such key` from `XINFO` on the deleted stream): the reader recreates
/// the group and reads on.
pub(crate) fn is_lost_group(e: &redis::RedisError) -> bool {
    matches!(e.code(), Some("NOGROUP" | "UNBLOCKED"))
        || (e.code() == Some("ERR") && e.detail() == Some("no such key"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_url_is_a_single_node_and_a_list_is_a_cluster() {
        assert!(!RedisClient::open("redis://127.0.0.1:6379/", false).unwrap().is_cluster());
        assert!(RedisClient::open("redis://127.0.0.1:6379/", true).unwrap().is_cluster());
        let list = RedisClient::open("redis://127.0.0.1:7001, redis://127.0.0.1:7002,", false).unwrap();
        assert!(list.is_cluster());
        assert!(RedisClient::open(" , ", false).is_err());
        assert!(RedisClient::open("redis://a:1,not a url", false).is_err());
    }

    #[test]
    fn debug_output_never_shows_a_url() {
        let c = RedisClient::open("redis://:hunter2@127.0.0.1:7001,redis://:hunter2@127.0.0.1:7002", false)
            .unwrap();
        assert!(!format!("{c:?}").contains("hunter2"));
        let c = RedisClient::open("redis://:hunter2@127.0.0.1:7001", false).unwrap();
        assert!(!format!("{c:?}").contains("hunter2"));
    }
}
