//! The one integration-test binary (one link step on a 2-core machine). Every test talks to
//! the real Postgres+pgvector named by `DATABASE_URL` (a fresh database each) and, where it
//! needs a provider, to the fault-injecting mock over real HTTP. Run it with scripts/test.sh.

mod architecture;
mod cluster;
mod config;
mod console;
mod contract;
mod costs;
mod dashboard;
mod deletions;
mod economy;
mod first_hour;
mod from_rust;
mod history;
mod identity;
mod ingest;
mod leases;
mod limits;
mod locks;
mod outage;
mod process;
mod provider;
mod reconcile;
mod relay;
mod restart;
mod revision_source;
mod revisions;
mod runtime;
mod seasons;
mod shards;
mod source;
mod streams;
mod superseded;
mod support;
mod sweeps;
mod table_source;
mod webdriver;
