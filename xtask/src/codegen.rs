//! `cargo xtask codegen`: generates what must agree with the CUDA side from its single sources.
//!
//! * `kernels/common/abi.cuh` (the kernel ABI, in the constrained format its header comment
//!   describes) → `crates/epcomm-abi/src/abi_generated.rs` (the Rust mirror: constants,
//!   one module per enum with `ALL`, its every value, `repr(C)` structs, and the expected ABI
//!   probe) and `kernels/common/abi_probe.cuh` (the device side of the probe: every constant,
//!   enumerator, struct size and field offset, in the same order).
//! * `kernels/images.txt` (the image manifest) → `crates/epcomm-kernels/src/images_generated.rs`
//!   (the table the crate's build script embeds from).
//!
//! `--check` generates in memory and fails, naming each file, when a checked-in file differs.

use std::fmt::Write as _;
use std::fs;
use std::path::{Path, PathBuf};

use crate::kernels::{IMAGES_FILE, ImagesError, KernelSource, parse_images};

/// The ABI header, workspace-relative.
pub const ABI_HEADER: &str = "kernels/common/abi.cuh";
/// The generated Rust mirror of the ABI, workspace-relative.
pub const ABI_RUST: &str = "crates/epcomm-abi/src/abi_generated.rs";
/// The generated device half of the ABI probe, workspace-relative.
pub const ABI_PROBE: &str = "kernels/common/abi_probe.cuh";
/// The generated image table, workspace-relative.
pub const IMAGES_RUST: &str = "crates/epcomm-kernels/src/images_generated.rs";

/// Errors of `codegen`.
#[derive(Debug, thiserror::Error)]
pub enum CodegenError {
    /// The ABI header does not follow its format.
    #[error("{ABI_HEADER}:{line}: {message}")]
    Parse {
        /// 1-based line number.
        line: usize,
        /// What is wrong.
        message: String,
    },
    /// The image manifest does not follow its format.
    #[error(transparent)]
    Images(#[from] ImagesError),
    /// A file could not be read or written.
    #[error("{action} {}: {source}", path.display())]
    Io {
        /// What was being done.
        action: &'static str,
        /// The file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// `--check`: checked-in files differ from a fresh generation.
    #[error(
        "generated file(s) out of date (run `cargo xtask codegen` and commit the result): {}",
        stale.join(", ")
    )]
    Stale {
        /// Workspace-relative paths.
        stale: Vec<String>,
    },
}

/// What `codegen` did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Files rewritten (those whose content changed).
    Written(Vec<String>),
    /// `--check`: every generated file is up to date.
    UpToDate(usize),
}

impl std::fmt::Display for Outcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Outcome::Written(files) if files.is_empty() => {
                write!(f, "codegen: every generated file was up to date")
            }
            Outcome::Written(files) => write!(f, "codegen: wrote {}", files.join(", ")),
            Outcome::UpToDate(n) => write!(f, "codegen: {n} generated file(s) up to date"),
        }
    }
}

/// Generates every file from the sources under `workspace`; with `check`, only compares.
pub fn run(workspace: &Path, check: bool) -> Result<Outcome, CodegenError> {
    let read = |rel: &str| {
        let path = workspace.join(rel);
        fs::read_to_string(&path).map_err(|source| CodegenError::Io {
            action: "reading",
            path,
            source,
        })
    };
    let abi = parse_abi(&read(ABI_HEADER)?)?;
    let images = parse_images(&read(IMAGES_FILE)?)?;
    let files = [
        (ABI_RUST, abi_rust(&abi)),
        (ABI_PROBE, abi_probe(&abi)),
        (IMAGES_RUST, images_rust(&images)),
    ];
    let mut changed = Vec::new();
    for (rel, text) in &files {
        if fs::read_to_string(workspace.join(rel)).ok().as_deref() != Some(text.as_str()) {
            changed.push(rel.to_string());
        }
    }
    if check {
        return if changed.is_empty() {
            Ok(Outcome::UpToDate(files.len()))
        } else {
            Err(CodegenError::Stale { stale: changed })
        };
    }
    for (rel, text) in files
        .iter()
        .filter(|(rel, _)| changed.iter().any(|c| c == rel))
    {
        let path = workspace.join(rel);
        fs::write(&path, text).map_err(|source| CodegenError::Io {
            action: "writing",
            path,
            source,
        })?;
    }
    Ok(Outcome::Written(changed))
}

/// A scalar type of the ABI.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Scalar {
    U64,
    U32,
    I32,
    Usize,
}

impl Scalar {
    fn parse(c: &str) -> Option<Scalar> {
        match c {
            "uint64_t" => Some(Scalar::U64),
            "uint32_t" => Some(Scalar::U32),
            "int32_t" => Some(Scalar::I32),
            "size_t" => Some(Scalar::Usize),
            _ => None,
        }
    }

    fn rust(self) -> &'static str {
        match self {
            Scalar::U64 => "u64",
            Scalar::U32 => "u32",
            Scalar::I32 => "i32",
            Scalar::Usize => "usize",
        }
    }

    /// A Rust expression of type u64 from `expr` of this type.
    fn to_u64(self, expr: &str) -> String {
        match self {
            Scalar::U64 => expr.to_string(),
            Scalar::U32 | Scalar::I32 | Scalar::Usize => format!("{expr} as u64"),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Member {
    /// C++ name (`kOpLayout`, `num_tokens`).
    name: String,
    /// Enumerators: the value as written; fields: the type.
    value: String,
    ty: Option<Scalar>,
    doc: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Item {
    Const {
        name: String,
        ty: Scalar,
        value: String,
        doc: Vec<String>,
    },
    Enum {
        name: String,
        module: String,
        prefix: String,
        doc: Vec<String>,
        members: Vec<Member>,
    },
    /// Members are fields; a member with an empty name is a group heading (its doc).
    Struct {
        name: String,
        doc: Vec<String>,
        members: Vec<Member>,
    },
}

/// An integer literal of the header (`3`, `3584`, `1u << 4`) as a Rust expression.
fn integer(text: &str) -> Option<String> {
    let number = |t: &str| {
        let digits = t.trim().trim_end_matches(['u', 'U', 'l', 'L']);
        (!digits.is_empty() && digits.chars().all(|c| c.is_ascii_digit()))
            .then(|| digits.to_string())
    };
    match text.split_once("<<") {
        Some((a, b)) => Some(format!("{} << {}", number(a)?, number(b)?)),
        None => number(text),
    }
}

fn is_ident(s: &str) -> bool {
    let mut chars = s.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// `kStatsAbortOffset` → `STATS_ABORT_OFFSET` (after dropping `prefix`).
fn screaming(name: &str, prefix: &str) -> String {
    let mut out = String::new();
    for (i, c) in name
        .strip_prefix(prefix)
        .unwrap_or(name)
        .chars()
        .enumerate()
    {
        if c.is_ascii_uppercase() && i > 0 {
            out.push('_');
        }
        out.push(c.to_ascii_uppercase());
    }
    out
}

/// Splits `code  ///< doc` into the code and the doc (if any).
fn trailing_doc(line: &str) -> (&str, Option<String>) {
    match line.split_once("///<") {
        Some((code, doc)) => (code.trim(), Some(doc.trim().to_string())),
        None => (line.trim(), None),
    }
}

fn parse_abi(text: &str) -> Result<Vec<Item>, CodegenError> {
    let mut items = Vec::new();
    let mut doc: Vec<String> = Vec::new();
    let mut open: Option<Item> = None;
    for (i, raw) in text.lines().enumerate() {
        let line = raw.trim();
        let err = |message: String| CodegenError::Parse {
            line: i + 1,
            message,
        };
        if let Some(item) = &mut open {
            let (enum_prefix, members) = match item {
                Item::Enum {
                    prefix, members, ..
                } => (Some(prefix.clone()), members),
                Item::Struct { members, .. } => (None, members),
                Item::Const { .. } => unreachable!("constants are never open"),
            };
            if line == "};" {
                items.push(open.take().expect("an item is open"));
                continue;
            }
            if let Some(more) = line.strip_prefix("///<") {
                let last = members
                    .last_mut()
                    .ok_or_else(|| err("`///<` before any member".into()))?;
                last.doc.push(more.trim().to_string());
                continue;
            }
            if line.is_empty() {
                continue;
            }
            if let Some(group) = line.strip_prefix("//") {
                if enum_prefix.is_some() {
                    return Err(err("plain comments are not allowed inside an enum".into()));
                }
                members.push(Member {
                    name: String::new(),
                    value: String::new(),
                    ty: None,
                    doc: vec![group.trim().to_string()],
                });
                continue;
            }
            let (code, member_doc) = trailing_doc(line);
            let member_doc = member_doc.into_iter().collect();
            match enum_prefix {
                Some(prefix) => {
                    let (name, value) = code
                        .strip_suffix(',')
                        .and_then(|c| c.split_once('='))
                        .ok_or_else(|| err(format!("expected `kName = value,`, found `{code}`")))?;
                    let (name, value) = (name.trim(), value.trim());
                    if !name.starts_with(prefix.as_str()) || !is_ident(name) {
                        return Err(err(format!(
                            "enumerator `{name}` lacks the prefix `{prefix}`"
                        )));
                    }
                    if screaming(name, &prefix) == "ALL" {
                        return Err(err(format!(
                            "enumerator `{name}` would be named `ALL`, the list of every value"
                        )));
                    }
                    let value = integer(value)
                        .ok_or_else(|| err(format!("`{value}` is not an integer literal")))?;
                    members.push(Member {
                        name: name.to_string(),
                        value,
                        ty: Some(Scalar::U32),
                        doc: member_doc,
                    });
                }
                None => {
                    let (ty, name) = code
                        .strip_suffix(';')
                        .and_then(|c| c.split_once(' '))
                        .ok_or_else(|| err(format!("expected `type name;`, found `{code}`")))?;
                    let ty = Scalar::parse(ty.trim())
                        .ok_or_else(|| err(format!("unsupported field type `{ty}`")))?;
                    let name = name.trim();
                    if !is_ident(name) {
                        return Err(err(format!(
                            "expected one field name, found `{name}` (one field per line)"
                        )));
                    }
                    members.push(Member {
                        name: name.to_string(),
                        value: String::new(),
                        ty: Some(ty),
                        doc: member_doc,
                    });
                }
            }
            continue;
        }
        if let Some(d) = line.strip_prefix("///") {
            doc.push(d.trim().to_string());
        } else if let Some(rest) = line.strip_prefix("constexpr ") {
            let (decl, value) = rest
                .strip_suffix(';')
                .and_then(|r| r.split_once('='))
                .ok_or_else(|| err("expected `constexpr type kName = value;`".into()))?;
            let (ty, name) = decl
                .trim()
                .split_once(' ')
                .ok_or_else(|| err("expected `constexpr type kName`".into()))?;
            let ty = Scalar::parse(ty).ok_or_else(|| err(format!("unsupported type `{ty}`")))?;
            let value = integer(value)
                .ok_or_else(|| err(format!("`{}` is not an integer literal", value.trim())))?;
            items.push(Item::Const {
                name: name.trim().to_string(),
                ty,
                value,
                doc: std::mem::take(&mut doc),
            });
        } else if let Some(rest) = line.strip_prefix("enum ") {
            let (decl, annotation) = rest.split_once("// rust: mod ").ok_or_else(|| {
                err("an enum needs `// rust: mod <module>, strip <prefix>`".into())
            })?;
            let (module, prefix) = annotation
                .split_once(", strip ")
                .ok_or_else(|| err("expected `// rust: mod <module>, strip <prefix>`".into()))?;
            let name = decl
                .trim()
                .strip_suffix(": uint32_t {")
                .ok_or_else(|| err("expected `enum Name : uint32_t {`".into()))?;
            open = Some(Item::Enum {
                name: name.trim().to_string(),
                module: module.trim().to_string(),
                prefix: prefix.trim().to_string(),
                doc: std::mem::take(&mut doc),
                members: Vec::new(),
            });
        } else if let Some(rest) = line.strip_prefix("struct ") {
            let name = rest
                .strip_suffix('{')
                .map(str::trim)
                .filter(|n| is_ident(n))
                .ok_or_else(|| err("expected `struct Name {`".into()))?;
            open = Some(Item::Struct {
                name: name.to_string(),
                doc: std::mem::take(&mut doc),
                members: Vec::new(),
            });
        } else if line.is_empty()
            || line.starts_with("//")
            || line.starts_with("#pragma once")
            || line.starts_with("#include <")
            || line == "namespace epcomm {"
            || line.starts_with("}  // namespace")
        {
            if !line.is_empty() && !doc.is_empty() {
                return Err(err(
                    "a `///` doc must be followed by the item it documents".into()
                ));
            }
        } else {
            return Err(err(format!("not part of the ABI format: `{line}`")));
        }
    }
    if open.is_some() {
        return Err(CodegenError::Parse {
            line: text.lines().count(),
            message: "unterminated enum or struct".into(),
        });
    }
    Ok(items)
}

/// Header doc text as rustdoc: brackets escaped outside code spans, and code spans that name a
/// generated item (`code`, `ErrorRecord::code`) turned into links.
fn rust_doc(text: &str, items: &[String]) -> String {
    let mut out = String::new();
    for (i, part) in text.split('`').enumerate() {
        if i % 2 == 1 {
            let head = part.split("::").next().unwrap_or(part);
            if items.iter().any(|n| n == head) {
                let _ = write!(out, "[`{part}`]");
            } else {
                let _ = write!(out, "`{part}`");
            }
        } else {
            out.push_str(&part.replace('[', "\\[").replace(']', "\\]"));
        }
    }
    out
}

const RUST_BANNER: &str = "// @generated by `cargo xtask codegen` from";

fn abi_rust(items: &[Item]) -> String {
    let names: Vec<String> = items
        .iter()
        .map(|item| match item {
            Item::Const { name, .. } => screaming(name, "k"),
            Item::Enum { module, .. } => module.clone(),
            Item::Struct { name, .. } => name.clone(),
        })
        .collect();
    let mut o = format!(
        "{RUST_BANNER} {ABI_HEADER}; do not edit.\n// Regenerate with `cargo xtask codegen`; CI runs `cargo xtask codegen --check`.\n"
    );
    let docs = |o: &mut String, doc: &[String], indent: &str| {
        for line in doc {
            let _ = writeln!(o, "{indent}/// {}", rust_doc(line, &names).trim_end());
        }
    };
    let mut probe: Vec<(String, String)> = Vec::new();
    for item in items {
        o.push('\n');
        match item {
            Item::Const {
                name,
                ty,
                value,
                doc,
            } => {
                docs(&mut o, doc, "");
                let rust = screaming(name, "k");
                let _ = writeln!(o, "pub const {rust}: {} = {value};", ty.rust());
                probe.push((name.clone(), ty.to_u64(&rust)));
            }
            Item::Enum {
                module,
                prefix,
                doc,
                members,
                ..
            } => {
                docs(&mut o, doc, "");
                let _ = writeln!(o, "pub mod {module} {{");
                let mut all = Vec::new();
                for m in members {
                    docs(&mut o, &m.doc, "    ");
                    let rust = screaming(&m.name, prefix);
                    let _ = writeln!(o, "    pub const {rust}: u32 = {};", m.value);
                    probe.push((
                        m.name.clone(),
                        Scalar::U32.to_u64(&format!("{module}::{rust}")),
                    ));
                    all.push(rust);
                }
                let _ = writeln!(
                    o,
                    "    /// Every value above, in header order.\n    pub const ALL: [u32; {}] = [{}];",
                    all.len(),
                    all.join(", ")
                );
                o.push_str("}\n");
            }
            Item::Struct { name, doc, members } => {
                docs(&mut o, doc, "");
                o.push_str("#[repr(C)]\n#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]\n");
                let _ = writeln!(o, "pub struct {name} {{");
                probe.push((
                    format!("sizeof({name})"),
                    format!("size_of::<{name}>() as u64"),
                ));
                for m in members {
                    let Some(ty) = m.ty else {
                        let _ = writeln!(o, "    // {}", m.doc.join(" "));
                        continue;
                    };
                    docs(&mut o, &m.doc, "    ");
                    let _ = writeln!(o, "    pub {}: {},", m.name, ty.rust());
                    probe.push((
                        format!("offsetof({name}, {})", m.name),
                        format!("offset_of!({name}, {}) as u64", m.name),
                    ));
                }
                o.push_str("}\n");
            }
        }
    }
    let _ = write!(
        o,
        "\n/// What `epcomm_abi_probe` writes, in its order: every constant, enumerator, struct size\n/// and field offset of the ABI, as the host sees it.\npub(crate) const ABI_PROBE: [(&str, u64); {}] = [\n",
        probe.len()
    );
    for (what, expr) in &probe {
        let _ = writeln!(o, "    ({what:?}, {expr}),");
    }
    o.push_str("];\n");
    o
}

fn abi_probe(items: &[Item]) -> String {
    let mut lines: Vec<String> = Vec::new();
    for item in items {
        match item {
            Item::Const { name, .. } => lines.push(name.clone()),
            Item::Enum { members, .. } => lines.extend(members.iter().map(|m| m.name.clone())),
            Item::Struct { name, members, .. } => {
                lines.push(format!("sizeof({name})"));
                lines.extend(
                    members
                        .iter()
                        .filter(|m| m.ty.is_some())
                        .map(|m| format!("offsetof({name}, {})", m.name)),
                );
            }
        }
    }
    let mut o = format!(
        "// @generated by `cargo xtask codegen` from {ABI_HEADER}; do not edit.\n\
         // The device half of the ABI probe: the host compares these words with its own view\n\
         // (crates/epcomm-abi/src/abi_generated.rs, ABI_PROBE) when it loads a module.\n\
         #pragma once\n#include <cstddef>\n#include <cstdint>\n\n#include \"common/abi.cuh\"\n\n\
         namespace epcomm {{\n\n\
         constexpr int kAbiProbeWords = {};\n\n\
         // Writes kAbiProbeWords words to `out` (one thread).\n\
         __device__ __forceinline__ void abi_probe(uint64_t* out) {{\n",
        lines.len()
    );
    for (i, what) in lines.iter().enumerate() {
        let _ = writeln!(o, "  out[{i}] = static_cast<uint64_t>({what});");
    }
    o.push_str("}\n\n}  // namespace epcomm\n");
    o
}

fn images_rust(images: &[KernelSource]) -> String {
    let mut o = format!(
        "{RUST_BANNER} {IMAGES_FILE}; do not edit.\n// Included by the build script (to embed each artifact) and by the library.\n\n/// Every kernel image: (name, artifact file, build, entry source, NVSHMEM release or \"\"), in\n/// manifest order.\npub(crate) const IMAGE_TABLE: [(&str, &str, &str, &str, &str); {}] = [\n",
        images.len()
    );
    for i in images {
        let _ = writeln!(
            o,
            "    ({:?}, {:?}, {:?}, {:?}, {:?}),",
            i.name,
            i.artifact,
            i.kind.word(),
            i.rel,
            i.nvshmem_release.as_deref().unwrap_or("")
        );
    }
    o.push_str("];\n");
    o
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::util::assert_contains_all;

    const HEADER: &str = "#pragma once\n#include <cstdint>\n\nnamespace epcomm {\n\n\
        /// Version.\nconstexpr uint64_t kAbiVersion = 3;\n\
        constexpr size_t kMaxWorld = 64;\n\n\
        /// Bits of `Args::flags`.\n\
        enum Flags : uint32_t {  // rust: mod flags, strip kFlag\n\
          kFlagA = 1u << 0,  ///< First [bit].\n\
          kFlagBigOne = 2,   ///< Second,\n\
                             ///< continued.\n\
        };\n\n\
        /// The args.\nstruct Args {\n  // Group.\n  uint64_t x;  ///< X.\n  int32_t n;\n  uint32_t flags;\n};\n\n\
        }  // namespace epcomm\n";

    #[test]
    fn parses_the_constrained_format() {
        let items = parse_abi(HEADER).expect("parse");
        assert_eq!(items.len(), 4);
        assert!(
            matches!(&items[0], Item::Const { name, value, .. } if name == "kAbiVersion" && value == "3")
        );
        let Item::Enum { members, .. } = &items[2] else {
            panic!("{items:?}")
        };
        assert_eq!(members[0].value, "1 << 0");
        assert_eq!(members[1].doc, ["Second,", "continued."]);
        let Item::Struct { members, .. } = &items[3] else {
            panic!("{items:?}")
        };
        assert_eq!(members.len(), 4, "a group heading and three fields");
    }

    #[test]
    fn generates_rust_and_the_probe_in_the_same_order() {
        let items = parse_abi(HEADER).expect("parse");
        let rust = abi_rust(&items);
        assert!(rust.starts_with(RUST_BANNER), "{rust}");
        assert_contains_all(
            &rust,
            &[
                "pub const ABI_VERSION: u64 = 3;",
                "pub const MAX_WORLD: usize = 64;",
                "/// Bits of [`Args::flags`].\npub mod flags {",
                "    /// First \\[bit\\].\n    pub const A: u32 = 1 << 0;",
                "    pub const BIG_ONE: u32 = 2;\n    /// Every value above, in header order.\n    pub const ALL: [u32; 2] = [A, BIG_ONE];\n}",
                "    // Group.\n    /// X.\n    pub x: u64,\n    pub n: i32,",
                "(\"offsetof(Args, flags)\", offset_of!(Args, flags) as u64),",
                "ABI_PROBE: [(&str, u64); 8]",
            ],
        );
        assert_contains_all(
            &abi_probe(&items),
            &[
                "constexpr int kAbiProbeWords = 8;",
                "  out[0] = static_cast<uint64_t>(kAbiVersion);",
                "  out[7] = static_cast<uint64_t>(offsetof(Args, flags));",
            ],
        );
    }

    #[test]
    fn rejects_what_the_format_does_not_allow() {
        let bad = |text: &str| parse_abi(text).expect_err(text).to_string();
        assert!(bad("struct A {\n  uint64_t a, b;\n};\n").contains(":2: expected one field name"));
        assert!(bad("struct A {\n  float a;\n};\n").contains("unsupported field type"));
        assert!(bad("enum E : uint32_t {\n  kA = 1,\n};\n").contains("rust: mod"));
        assert!(
            bad("enum E : uint32_t {  // rust: mod e, strip kE\n  kA = 1,\n};\n")
                .contains("lacks the prefix")
        );
        assert!(
            bad("enum E : uint32_t {  // rust: mod e, strip kE\n  kEAll = 1,\n};\n")
                .contains("would be named `ALL`")
        );
        assert!(bad("constexpr uint64_t kA = 1 + 2;\n").contains("not an integer literal"));
        assert!(bad("int x = 3;\n").contains("not part of the ABI format"));
        assert!(bad("struct A {\n  uint64_t a;\n").contains("unterminated"));
    }

    #[test]
    fn checked_in_files_are_up_to_date() {
        let workspace = Path::new(env!("CARGO_MANIFEST_DIR"))
            .parent()
            .expect("workspace");
        match run(workspace, true) {
            Ok(Outcome::UpToDate(3)) => {}
            other => panic!("{other:?}"),
        }
    }
}
