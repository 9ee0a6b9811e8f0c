//! The crate's shape, held: the layers of `docs/architecture.md` (read from its table, so the
//! document and this test cannot drift apart), no import against their direction, no import
//! cycle between files, and no source file over [`MAX_LINES`].
//!
//! Imports are read from the code as text: every `crate::…` and `super::…` path outside
//! comments and `#[cfg(test)]` modules (a `use` line or a path written inline), resolved to
//! the deepest module file it names. A module's own parent and children are left out (a
//! parent declares its children and re-exports them; that is not a dependency between
//! concerns). The binary (`src/main.rs`, `src/app/`) is the top layer, `app`.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The most lines a source file under `src/` or `benches/` may have: past it a file holds
/// more than one concern, and its first doc comment cannot say what it owns.
const MAX_LINES: usize = 1_200;

type ModPath = Vec<String>;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The module a file under `src/` is: `src/store/mod.rs` and `src/store.rs` are `store`,
/// `src/main.rs` and `src/app/…` belong to the binary, whose modules are spelled `app…`.
fn module_of(rel: &Path) -> ModPath {
    let mut parts: Vec<String> =
        rel.with_extension("").iter().map(|p| p.to_string_lossy().into_owned()).collect();
    if matches!(parts.last().map(String::as_str), Some("mod" | "lib")) {
        parts.pop();
    }
    if parts == ["main"] {
        return vec!["app".into()];
    }
    parts
}

/// The code of `src` without comments and `#[cfg(test)]` modules (tests may reach anywhere).
fn code_of(src: &str) -> String {
    let mut out = String::with_capacity(src.len());
    let mut lines = src.lines();
    while let Some(line) = lines.next() {
        let trimmed = line.trim_start();
        if trimmed.starts_with("#[cfg(test)]") {
            // Skip the item that follows: to the end of its braces.
            let mut depth = 0i32;
            let mut opened = false;
            for next in lines.by_ref() {
                for c in next.chars() {
                    match c {
                        '{' => {
                            depth += 1;
                            opened = true;
                        }
                        '}' => depth -= 1,
                        _ => {}
                    }
                }
                if (opened && depth <= 0) || (!opened && next.trim_end().ends_with(';')) {
                    break;
                }
            }
            continue;
        }
        let code = match line.find("//") {
            Some(i) => &line[..i],
            None => line,
        };
        out.push_str(code);
        out.push('\n');
    }
    out
}

/// The paths written after each `crate::` and `super::` in `code`, brace groups expanded:
/// `crate::store::{Store, park::OnNewerParked}` gives `crate store Store` and
/// `crate store park OnNewerParked`.
fn paths_in(code: &str) -> Vec<Vec<String>> {
    let bytes = code.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        let starts = |word: &str| bytes[i..].starts_with(word.as_bytes());
        let boundary =
            i == 0 || !(bytes[i - 1].is_ascii_alphanumeric() || bytes[i - 1] == b'_' || bytes[i - 1] == b':');
        if boundary && (starts("crate::") || starts("super::")) {
            let (paths, end) = expand(code, i, Vec::new());
            out.extend(paths);
            i = end.max(i + 1);
        } else {
            i += 1;
        }
    }
    out
}

/// Reads one path (`a::b::{c, d::e}`) from `code` at `at`, after `prefix`; returns the full
/// paths and where the path ends.
fn expand(code: &str, mut at: usize, prefix: Vec<String>) -> (Vec<Vec<String>>, usize) {
    let bytes = code.as_bytes();
    let mut path = prefix;
    loop {
        while at < bytes.len() && bytes[at].is_ascii_whitespace() {
            at += 1;
        }
        if at < bytes.len() && bytes[at] == b'{' {
            at += 1;
            let mut all = Vec::new();
            loop {
                while at < bytes.len() && (bytes[at].is_ascii_whitespace() || bytes[at] == b',') {
                    at += 1;
                }
                if at >= bytes.len() || bytes[at] == b'}' {
                    return (all, at + 1);
                }
                let (inner, end) = expand(code, at, path.clone());
                all.extend(inner);
                at = end;
            }
        }
        let start = at;
        while at < bytes.len() && (bytes[at].is_ascii_alphanumeric() || bytes[at] == b'_') {
            at += 1;
        }
        if start == at {
            return (vec![path], at);
        }
        let word = &code[start..at];
        if word != "self" {
            path.push(word.to_string());
        }
        if bytes[at..].starts_with(b"::") {
            at += 2;
        } else {
            // `as name`, `,`, `;`, `(`, `}`…: the path ends here.
            let mut end = at;
            let rest = code.get(at..).unwrap_or("").trim_start();
            if let Some(alias) = rest.strip_prefix("as ") {
                end = code.len() - alias.trim_start().len();
                while end < bytes.len() && (bytes[end].is_ascii_alphanumeric() || bytes[end] == b'_') {
                    end += 1;
                }
            }
            return (vec![path], end);
        }
    }
}

/// The deepest module of `modules` that `path` (written in module `from`) names.
fn resolve(from: &ModPath, path: &[String], modules: &BTreeSet<ModPath>) -> Option<ModPath> {
    let mut base: ModPath;
    let mut rest = path;
    if rest.first().is_some_and(|w| w == "crate") {
        base = if from.first().is_some_and(|m| m == "app") { vec!["app".into()] } else { Vec::new() };
        rest = &rest[1..];
        // The binary's crate root is main.rs, whose only module is `app`.
        if base == ["app"] && rest.first().is_some_and(|w| w == "app") {
            rest = &rest[1..];
        }
    } else {
        // `super` of a module is its parent, whether it is `store/mod.rs` or `store.rs`.
        base = from.clone();
        while rest.first().is_some_and(|w| w == "super") {
            base.pop();
            rest = &rest[1..];
        }
    }
    let mut best = None;
    let mut candidate = base.clone();
    if modules.contains(&candidate) {
        best = Some(candidate.clone());
    }
    for word in rest {
        candidate.push(word.clone());
        if modules.contains(&candidate) {
            best = Some(candidate.clone());
        } else {
            break;
        }
    }
    best
}

fn related(a: &ModPath, b: &ModPath) -> bool {
    a.starts_with(b) || b.starts_with(a)
}

fn name(m: &ModPath) -> String {
    if m.is_empty() { "crate".into() } else { m.join("::") }
}

/// The layers of `docs/architecture.md`: its table's rows `| N name | `a`, `b` | … |`, each
/// module (a top-level module of the library, or `app`) with the number of its layer.
fn layers_from_doc() -> BTreeMap<String, (u32, String)> {
    let doc = std::fs::read_to_string(root().join("docs/architecture.md")).expect("docs/architecture.md");
    let mut layers = BTreeMap::new();
    for line in doc.lines() {
        let cells: Vec<&str> = line.split('|').map(str::trim).collect();
        if cells.len() < 4 {
            continue;
        }
        let mut head = cells[1].split_whitespace();
        let Some(Ok(n)) = head.next().map(str::parse::<u32>) else { continue };
        let layer: String = head.collect::<Vec<_>>().join(" ");
        for module in cells[2].split(',') {
            let module = module.trim().trim_matches('`');
            assert!(!module.is_empty(), "docs/architecture.md: layer {n} lists an empty module");
            let old = layers.insert(module.to_string(), (n, layer.clone()));
            assert!(old.is_none(), "docs/architecture.md: `{module}` is in two layers");
        }
    }
    assert!(layers.len() > 5, "docs/architecture.md: the layer table was not found");
    layers
}

struct Crate {
    modules: BTreeSet<ModPath>,
    /// file module -> (module it imports -> a path written for it, for the message)
    imports: BTreeMap<ModPath, BTreeMap<ModPath, String>>,
}

fn read_crate() -> Crate {
    let src = root().join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let mut by_module = BTreeMap::new();
    for f in &files {
        let rel = f.strip_prefix(&src).unwrap().to_path_buf();
        by_module.insert(module_of(&rel), rel);
    }
    let modules: BTreeSet<ModPath> = by_module.keys().cloned().collect();
    let mut imports = BTreeMap::new();
    for (module, rel) in &by_module {
        let code = code_of(&std::fs::read_to_string(src.join(rel)).unwrap());
        let mut out: BTreeMap<ModPath, String> = BTreeMap::new();
        for path in paths_in(&code) {
            if let Some(target) = resolve(module, &path, &modules)
                && !related(module, &target)
            {
                out.entry(target).or_insert_with(|| path.join("::"));
            }
        }
        imports.insert(module.clone(), out);
    }
    Crate { modules, imports }
}

#[test]
fn every_import_runs_down_the_layers_of_the_architecture_document() {
    let layers = layers_from_doc();
    let krate = read_crate();
    let mut problems = Vec::new();
    let top_level: BTreeSet<String> = krate.modules.iter().filter_map(|m| m.first().cloned()).collect();
    for module in &top_level {
        if !layers.contains_key(module) {
            problems.push(format!("`{module}` is in no layer of docs/architecture.md: add it to the table"));
        }
    }
    for listed in layers.keys() {
        if !top_level.contains(listed) {
            problems.push(format!("docs/architecture.md lists `{listed}`, which is no module of src/"));
        }
    }
    for (from, targets) in &krate.imports {
        let Some(from_top) = from.first() else { continue };
        for (to, written) in targets {
            let Some(to_top) = to.first() else { continue };
            if from_top == to_top {
                continue;
            }
            let (Some((lf, nf)), Some((lt, nt))) = (layers.get(from_top), layers.get(to_top)) else {
                continue;
            };
            if lt >= lf {
                problems.push(format!(
                    "{} (layer {lf} {nf}) imports {} (layer {lt} {nt}) as `{written}`: \
                     a module may use only the layers below its own",
                    name(from),
                    name(to)
                ));
            }
        }
    }
    assert!(
        problems.is_empty(),
        "{} import(s) against the layering:\n{}",
        problems.len(),
        problems.join("\n")
    );
}

#[test]
fn no_two_files_import_each_other_even_through_others() {
    let krate = read_crate();
    // Depth-first search for a back edge; reports each cycle once, as the chain of files.
    let mut state: BTreeMap<&ModPath, u8> = BTreeMap::new(); // 1 on the stack, 2 done
    let mut stack: Vec<&ModPath> = Vec::new();
    let mut cycles: Vec<String> = Vec::new();
    fn visit<'a>(
        m: &'a ModPath,
        krate: &'a Crate,
        state: &mut BTreeMap<&'a ModPath, u8>,
        stack: &mut Vec<&'a ModPath>,
        cycles: &mut Vec<String>,
    ) {
        state.insert(m, 1);
        stack.push(m);
        if let Some(targets) = krate.imports.get(m) {
            for (to, written) in targets {
                match state.get(to) {
                    Some(1) => {
                        let at = stack.iter().position(|s| *s == to).unwrap();
                        let chain: Vec<String> = stack[at..].iter().map(|s| name(s)).collect();
                        cycles.push(format!("{} -> {} (as `{written}`)", chain.join(" -> "), name(to)));
                    }
                    Some(_) => {}
                    None => visit(to, krate, state, stack, cycles),
                }
            }
        }
        stack.pop();
        state.insert(m, 2);
    }
    for m in &krate.modules {
        if !state.contains_key(m) {
            visit(m, &krate, &mut state, &mut stack, &mut cycles);
        }
    }
    assert!(cycles.is_empty(), "{} import cycle(s):\n{}", cycles.len(), cycles.join("\n"));
}

#[test]
fn no_source_file_is_over_the_line_limit() {
    let mut files = Vec::new();
    rust_files(&root().join("src"), &mut files);
    rust_files(&root().join("benches"), &mut files);
    let mut over: Vec<String> = files
        .iter()
        .filter_map(|f| {
            let lines = std::fs::read_to_string(f).unwrap().lines().count();
            (lines > MAX_LINES)
                .then(|| format!("{} has {lines} lines", f.strip_prefix(root()).unwrap().display()))
        })
        .collect();
    over.sort();
    assert!(over.is_empty(), "over {MAX_LINES} lines, split by concern:\n{}", over.join("\n"));
}

#[test]
fn the_import_reader_sees_what_rust_would() {
    // The reader itself, on the forms the crate uses: a test that cannot see an import
    // cannot fail on it.
    let code = code_of(
        "use crate::store::{Store, park::OnNewerParked, self};\n\
         use super::{Console, actions as acts};\n\
         // use crate::hidden::Nope;\n\
         fn f() { crate::relay::sql::backlog(x); let u = \"x\"; }\n\
         #[cfg(test)]\nmod tests {\n    use crate::everything::Else;\n}\n\
         use crate::after::Tests;\n",
    );
    let paths: Vec<String> = paths_in(&code).into_iter().map(|p| p.join("::")).collect();
    assert_eq!(
        paths,
        [
            "crate::store::Store",
            "crate::store::park::OnNewerParked",
            "crate::store",
            "super::Console",
            "super::actions",
            "crate::relay::sql::backlog",
            "crate::after::Tests",
        ]
    );
    let modules: BTreeSet<ModPath> =
        [vec![], vec!["store".into()], vec!["store".into(), "park".into()]].into_iter().collect();
    let from: ModPath = vec!["store".into(), "write".into()];
    let park = resolve(&from, &["super".into(), "park".into(), "X".into()], &modules);
    assert_eq!(park, Some(vec!["store".to_string(), "park".to_string()]));
}
