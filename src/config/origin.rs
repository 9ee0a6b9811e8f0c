//! Where a value came from, and the errors that name it.

use super::*;

/// Where a value came from, named in every error about it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Origin {
    /// A command-line flag, e.g. `--concurrency`.
    Flag(String),
    /// An environment variable, e.g. `EMBED_DLQ_BASE_URL`.
    Env(String),
    /// A key of a config file.
    File {
        /// The config file.
        path: PathBuf,
        /// The section and key, as `[section] key`.
        key: String,
    },
    /// The built-in default.
    Default,
}

impl fmt::Display for Origin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Origin::Flag(name) => write!(f, "flag {name}"),
            Origin::Env(var) => write!(f, "environment variable {var}"),
            Origin::File { path, key } => write!(f, "{} {key}", path.display()),
            Origin::Default => write!(f, "default"),
        }
    }
}

/// Which settings the command line or the environment gave, by clap argument id (the field
/// name, which is also the file key).
#[derive(Debug, Clone, Default)]
pub struct Origins {
    by_id: HashMap<String, Origin>,
}

impl Origins {
    /// Records the origin of every argument of `matches` (and its subcommands) that came from
    /// the command line or the environment. `cmd` is the command `matches` was parsed with.
    pub fn from_matches(cmd: &clap::Command, matches: &clap::ArgMatches) -> Origins {
        let mut cmd = cmd.clone();
        cmd.build();
        let mut origins = Origins::default();
        origins.walk(&cmd, matches);
        origins
    }

    fn walk(&mut self, cmd: &clap::Command, m: &clap::ArgMatches) {
        use clap::parser::ValueSource;
        for id in m.ids() {
            let id = id.as_str();
            let Some(arg) = cmd.get_arguments().find(|a| a.get_id() == id) else { continue };
            let origin = match m.value_source(id) {
                Some(ValueSource::CommandLine) => {
                    Origin::Flag(arg.get_long().map(|l| format!("--{l}")).unwrap_or_else(|| id.to_string()))
                }
                Some(ValueSource::EnvVariable) => {
                    Origin::Env(arg.get_env().map(|e| e.to_string_lossy().into_owned()).unwrap_or_default())
                }
                _ => continue,
            };
            self.by_id.insert(id.to_string(), origin);
        }
        if let Some((name, sub)) = m.subcommand()
            && let Some(sc) = cmd.find_subcommand(name)
        {
            self.walk(sc, sub);
        }
    }

    /// The origin of a value the command line layer holds for `key`.
    pub(super) fn of_flag(&self, key: &str) -> Origin {
        self.by_id.get(key).cloned().unwrap_or_else(|| Origin::Flag(format!("--{}", key.replace('_', "-"))))
    }
}

/// A setting that cannot be used. Every variant names the setting and, where it has one, the
/// source of the value (flag, environment variable, or file and key).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// The file cannot be read or parsed (an unknown key, a value of the wrong type).
    #[error("config file {}: {problem}", path.display())]
    File {
        /// The config file.
        path: PathBuf,
        /// Why it cannot be read or parsed.
        problem: String,
    },
    /// `allowed` is the documented range, e.g. `1..=256`.
    #[error("{setting} = {value} (from {origin}) is out of range: allowed {allowed}")]
    OutOfRange {
        /// The setting's key, e.g. `concurrency`.
        setting: &'static str,
        /// The value given, as given.
        value: String,
        /// Where the value came from.
        origin: Origin,
        /// The documented range.
        allowed: String,
    },
    /// A value of the right type that cannot work (e.g. a base URL that is not http(s)).
    #[error("{setting} (from {origin}): {problem}")]
    Invalid {
        /// The setting's key.
        setting: &'static str,
        /// Where the value came from.
        origin: Origin,
        /// Why the value cannot work.
        problem: String,
    },
    /// A setting the command needs was given nowhere.
    #[error("no {setting}: {hint}")]
    Missing {
        /// The setting's key.
        setting: &'static str,
        /// How to give it (flag, variable or key).
        hint: &'static str,
    },
}
