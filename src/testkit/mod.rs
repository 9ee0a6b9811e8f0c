//! The test kit: what the demo, the integration tests, the benchmarks and users' own tests
//! need to exercise a pipeline without a real provider or a hand-made database.
//!
//! - [`mock_provider`]: a fault-injecting, OpenAI-compatible embeddings server over real HTTP
//!   (the `mock-provider` command serves it, so users can try their setup against it).
//! - [`corpus`]: a synthetic JSONL corpus with poison inputs and broken lines, and the facts
//!   to check outcomes against.
//! - `db` (feature `testkit`): a fresh (migrated or unmigrated) database per test, always dropped with its value.
//! - `proxy` (feature `testkit`): a TCP proxy that makes Postgres or Redis unreachable for as long as a test wants.
//! - `seed_model` (feature `testkit`): the seed write-up's one-input-per-request retry design, simulated against
//!   the mock's fault model, for the provider-economy benchmark's comparison.
//!
//! None of it is used on the production path: `ingest`, `serve`, `replay`, `reconcile` and
//! the operator commands never call into this module. The mock provider and the corpus are in
//! the default build because the `mock-provider` and `demo` commands are; the database
//! fixtures, the proxy and the seed model only with the `testkit` feature, which the tests,
//! the benchmarks and the examples turn on (a dev-dependency of the crate on itself), so a
//! default build carries none of them.

pub mod corpus;
#[cfg(feature = "testkit")]
pub mod db;
pub mod mock_provider;
#[cfg(feature = "testkit")]
pub mod proxy;
#[cfg(feature = "testkit")]
pub mod seed_model;

#[cfg(feature = "testkit")]
pub use db::TestDb;
