//! The one place an HTTP client is made (the provider client, the console's health probes):
//! reqwest is built without a TLS crypto provider of its own, and rustls' `ring` provider is
//! installed for the process here. `aws-lc-rs`, reqwest's default, compiles a C library of
//! its own, the slowest crate of the whole build.

/// A `reqwest` client builder that can build: installs `ring` as the process's rustls crypto
/// provider first, unless the program installed one already (then that one is used). Use it
/// instead of `reqwest::Client::builder()` (and `reqwest::Client::new()`, which panics when
/// no provider is installed).
pub fn client_builder() -> reqwest::ClientBuilder {
    install_crypto_provider();
    reqwest::Client::builder()
}

/// Installs `ring` as the process-wide rustls crypto provider if none is installed yet.
/// Idempotent; a provider the program installed first is kept.
pub fn install_crypto_provider() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // Err: another provider was installed first, and it serves as well.
        let _ = rustls::crypto::ring::default_provider().install_default();
    });
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_client_builds_without_a_provider_installed_by_the_caller() {
        super::client_builder().build().expect("a client builds");
        // Again: the second install is a no-op, not a panic.
        super::client_builder().build().expect("a client builds twice");
    }
}
