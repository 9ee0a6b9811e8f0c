//! Publishes document chunks to an embed-dlq source stream from Rust, with redis-rs.
//!
//! Each chunk is one stream entry with the fields `doc_id`, `chunk_index`, `text` and
//! `metadata` (a JSON object, as text): the format in docs/sources.md. Then
//! `embed-dlq ingest --from-stream chunks` (or `serve` with a `[source]`) embeds them and
//! acknowledges each entry once its vector or DLQ row has committed.
//!
//! ```sh
//! REDIS_URL=redis://127.0.0.1:6379 cargo run --example produce_chunks -- chunks 1000
//! embed-dlq ingest --from-stream chunks --idle-exit-ms 2000
//! ```
//!
//! On a Redis Cluster, `REDIS_URL` lists the seed nodes, comma-separated.

use embed_dlq::model::Chunk;

/// The fields of one entry for `chunk`, in the documented format.
pub fn entry_fields(chunk: &Chunk) -> Vec<(&'static str, String)> {
    let mut fields = vec![
        ("doc_id", chunk.doc_id.clone()),
        ("chunk_index", chunk.chunk_index.to_string()),
        ("text", chunk.text.clone()),
    ];
    if let Some(metadata) = &chunk.metadata {
        fields.push(("metadata", metadata.to_string()));
    }
    fields
}

/// Publishes `chunks` to `stream` through `redis` (any connection: single node or cluster),
/// pipelined 500 at a time; returns the entry ids.
pub async fn publish<C: redis::aio::ConnectionLike>(
    redis: &mut C,
    stream: &str,
    chunks: &[Chunk],
) -> redis::RedisResult<Vec<String>> {
    let mut ids = Vec::with_capacity(chunks.len());
    for batch in chunks.chunks(500) {
        let mut pipe = redis::pipe();
        for chunk in batch {
            let mut cmd = redis::cmd("XADD");
            cmd.arg(stream).arg("*");
            for (k, v) in entry_fields(chunk) {
                cmd.arg(k).arg(v);
            }
            pipe.add_command(cmd);
        }
        let got: Vec<String> = pipe.query_async(redis).await?;
        ids.extend(got);
    }
    Ok(ids)
}

/// `count` sample chunks, four to a document.
pub fn sample_chunks(prefix: &str, count: usize) -> Vec<Chunk> {
    (0..count)
        .map(|i| Chunk {
            doc_id: format!("{prefix}-{}", i / 4),
            chunk_index: (i % 4) as i32,
            text: format!("Chunk {i} of the {prefix} corpus, published from Rust."),
            metadata: Some(serde_json::json!({"producer": "rust", "n": i})),
        })
        .collect()
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let stream = args.next().unwrap_or_else(|| "chunks".into());
    let count: usize = args.next().map(|n| n.parse()).transpose()?.unwrap_or(100);
    let url = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
    let client = embed_dlq::streams::client(&url)?;
    let mut redis = client.managed().await?;
    let ids = publish(&mut redis, &stream, &sample_chunks("rs", count)).await?;
    println!("published {} entries to {stream}", ids.len());
    Ok(())
}
