//! Bounded YAML loading: the one way the workspace reads YAML that comes from outside (job
//! manifests over the API and the CLI, `tpu-env` metadata). It owns the limits; what the
//! documents mean is the caller's business.
//!
//! YAML aliases (`*name`) repeat the node their anchor (`&name`) names, so a small text can
//! stand for a huge value: 20,000 aliases of one 10 KB scalar are 259 KB of text and 200 MB
//! of data. [`load`] first walks each document without building anything and counts its
//! expanded size, each alias counted as a full copy of what it names; past the limit it stops
//! and refuses the text. The expanded size is the bytes of every scalar plus one per node
//! (about what the data takes written out as flow YAML or JSON), and the limit is
//! [`EXPANSION_FACTOR`] times the input's size, at least [`MIN_EXPANSION_LIMIT`]: text without
//! aliases expands to at most about 1.5 times itself (`{a, b}` reads as `{a: null, b: null}`),
//! and the floor leaves room for the usual anchors of a small manifest (a shared `env` or
//! `resources` block used a few times). Only then is the text deserialized for real.
//!
//! Deep flow nesting (`[[[[...]]]]`) costs libyaml's scanner time in the square of the depth:
//! in an optimized build 20,000 levels take 0.8 s and 60,000 levels (120 KB) 8 s. serde_norway
//! stops at 128 levels, but only after libyaml has scanned the whole text; nesting in block
//! style costs linear time. So before libyaml sees the text, [`load`] runs a linear pre-scan
//! that follows libyaml's scanner rules for what is a token (comments, quoted, plain and block
//! scalars, indentation, simple keys, anchors, tags) and refuses the text when flow
//! collections nest deeper than [`MAX_FLOW_DEPTH`]. Where libyaml would fail with an error,
//! the pre-scan either stops too (nothing past that point costs libyaml anything) or goes on
//! counting, so it never sees less nesting than libyaml does; the tests check it against
//! serde_norway's own output with brackets, quotes and line breaks in every kind of scalar.

use std::cell::Cell;
use std::fmt;

use serde::de::{self, DeserializeOwned, DeserializeSeed, Visitor};

/// The expanded size may be this many times the input's size.
pub const EXPANSION_FACTOR: usize = 4;
/// The expanded size is always allowed up to this many bytes, whatever the input's size.
pub const MIN_EXPANSION_LIMIT: usize = 64 * 1024;
/// Deepest nesting of flow collections (`[...]`, `{...}`) accepted. Kubernetes manifests nest
/// a handful of levels; serde_norway refuses more than 128 levels of any kind anyway.
pub const MAX_FLOW_DEPTH: usize = 64;

/// YAML that cannot be loaded: `what` names the input (`manifest`, a file's path).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{what}: {problem}")]
pub struct YamlError {
    pub what: String,
    pub problem: Problem,
}

/// What is wrong with the YAML, without the input's name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Problem {
    /// Not YAML, or not of the shape the caller asked for (serde_norway's message, with the
    /// line and column).
    #[error("invalid YAML: {0}")]
    Invalid(String),
    #[error(
        "expands to more than {limit} bytes through YAML aliases (limit: {EXPANSION_FACTOR} times the input's {len} bytes, at least {MIN_EXPANSION_LIMIT}); remove the aliases (*name) and write the values out"
    )]
    Expansion { limit: usize, len: usize },
    #[error("holds {0} YAML documents; expected one")]
    Documents(usize),
    #[error(
        "nests flow collections ([...] or {{...}}) more than {MAX_FLOW_DEPTH} deep at line {line} column {column}; flatten the data or write it in block style"
    )]
    TooDeep { line: usize, column: usize },
}

/// The most bytes `text` may expand to (see the module docs).
pub fn expansion_limit(text: &str) -> usize {
    text.len().saturating_mul(EXPANSION_FACTOR).max(MIN_EXPANSION_LIMIT)
}

/// Loads every document of `text` as a `T`, within the limits of this module; `what` names the
/// input in errors.
pub fn load<T: DeserializeOwned>(text: &str, what: &str) -> Result<Vec<T>, YamlError> {
    let fail = |problem| YamlError { what: what.to_owned(), problem };
    if let Err((line, column)) = flow_depth(text, MAX_FLOW_DEPTH) {
        return Err(fail(Problem::TooDeep { line, column }));
    }
    let budget = Budget { used: Cell::new(0), limit: expansion_limit(text) };
    for doc in serde_norway::Deserializer::from_str(text) {
        if let Err(e) = Count(&budget).deserialize(doc) {
            if budget.used.get() > budget.limit {
                return Err(fail(Problem::Expansion { limit: budget.limit, len: text.len() }));
            }
            return Err(fail(Problem::Invalid(e.to_string())));
        }
    }
    let mut out = Vec::new();
    for doc in serde_norway::Deserializer::from_str(text) {
        out.push(T::deserialize(doc).map_err(|e| fail(Problem::Invalid(e.to_string())))?);
    }
    Ok(out)
}

/// [`load`] for input that must hold exactly one document (an empty text is one empty
/// document, `null`).
pub fn load_one<T: DeserializeOwned>(text: &str, what: &str) -> Result<T, YamlError> {
    let mut docs = load(text, what)?;
    match docs.len() {
        1 => Ok(docs.remove(0)),
        n => Err(YamlError { what: what.to_owned(), problem: Problem::Documents(n) }),
    }
}

/// The expanded size counted so far and its limit.
struct Budget {
    used: Cell<usize>,
    limit: usize,
}

/// A mapping key: counted like any value, and returned as text when it is a scalar (for the
/// duplicate check; a key that is itself a collection is counted, not compared).
struct MapKey<'a>(Count<'a>);

impl<'de> DeserializeSeed<'de> for MapKey<'_> {
    type Value = Option<String>;

    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<Option<String>, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for MapKey<'_> {
    type Value = Option<String>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a mapping key")
    }

    fn visit_bool<E: de::Error>(self, v: bool) -> Result<Option<String>, E> {
        self.0.add(1).map(|()| Some(v.to_string()))
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Option<String>, E> {
        self.0.add(1).map(|()| Some(v.to_string()))
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Option<String>, E> {
        self.0.add(1).map(|()| Some(v.to_string()))
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Option<String>, E> {
        self.0.add(1).map(|()| Some(v.to_string()))
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Option<String>, E> {
        self.0.add(v.len().saturating_add(1)).map(|()| Some(v.to_owned()))
    }

    fn visit_unit<E: de::Error>(self) -> Result<Option<String>, E> {
        self.0.add(1).map(|()| Some("null".to_owned()))
    }

    fn visit_none<E: de::Error>(self) -> Result<Option<String>, E> {
        self.visit_unit()
    }

    fn visit_bytes<E: de::Error>(self, v: &[u8]) -> Result<Option<String>, E> {
        self.0.visit_bytes(v).map(|()| None)
    }

    fn visit_some<D: de::Deserializer<'de>>(self, d: D) -> Result<Option<String>, D::Error> {
        self.0.visit_some(d).map(|()| None)
    }

    fn visit_newtype_struct<D: de::Deserializer<'de>>(
        self,
        d: D,
    ) -> Result<Option<String>, D::Error> {
        self.0.visit_newtype_struct(d).map(|()| None)
    }

    fn visit_seq<A: de::SeqAccess<'de>>(self, seq: A) -> Result<Option<String>, A::Error> {
        self.0.visit_seq(seq).map(|()| None)
    }

    fn visit_map<A: de::MapAccess<'de>>(self, map: A) -> Result<Option<String>, A::Error> {
        self.0.visit_map(map).map(|()| None)
    }

    fn visit_enum<A: de::EnumAccess<'de>>(self, data: A) -> Result<Option<String>, A::Error> {
        self.0.visit_enum(data).map(|()| None)
    }
}

/// Refuses a JSON text that repeats a key within one object (serde_json keeps the last one
/// silently): the same check [`load`] makes for YAML.
pub fn reject_duplicate_keys_json(text: &str) -> Result<(), String> {
    let budget = Budget { used: Cell::new(0), limit: usize::MAX };
    let mut d = serde_json::Deserializer::from_str(text);
    Count(&budget).deserialize(&mut d).map_err(|e| e.to_string())
}

/// Walks a document, following aliases, and counts its expanded size into the budget; fails
/// as soon as the budget is spent, so the walk costs at most the limit.
#[derive(Clone, Copy)]
struct Count<'a>(&'a Budget);

impl Count<'_> {
    fn add<E: de::Error>(self, n: usize) -> Result<(), E> {
        let used = self.0.used.get().saturating_add(n);
        self.0.used.set(used);
        if used > self.0.limit { Err(E::custom("expansion limit reached")) } else { Ok(()) }
    }
}

impl<'de> DeserializeSeed<'de> for Count<'_> {
    type Value = ();

    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Count<'_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any YAML value")
    }

    fn visit_bool<E: de::Error>(self, _: bool) -> Result<(), E> {
        self.add(1)
    }

    fn visit_i64<E: de::Error>(self, _: i64) -> Result<(), E> {
        self.add(1)
    }

    fn visit_u64<E: de::Error>(self, _: u64) -> Result<(), E> {
        self.add(1)
    }

    fn visit_f64<E: de::Error>(self, _: f64) -> Result<(), E> {
        self.add(1)
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<(), E> {
        self.add(v.len().saturating_add(1))
    }

    fn visit_bytes<E: de::Error>(self, v: &[u8]) -> Result<(), E> {
        self.add(v.len().saturating_add(1))
    }

    fn visit_unit<E: de::Error>(self) -> Result<(), E> {
        self.add(1)
    }

    fn visit_none<E: de::Error>(self) -> Result<(), E> {
        self.add(1)
    }

    fn visit_some<D: de::Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        self.add(1)?;
        d.deserialize_any(self)
    }

    fn visit_newtype_struct<D: de::Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        self.add(1)?;
        d.deserialize_any(self)
    }

    fn visit_seq<A: de::SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        self.add(1)?;
        while seq.next_element_seed(self)?.is_some() {}
        Ok(())
    }

    fn visit_map<A: de::MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        self.add(1)?;
        // A key given twice: the second would silently replace the first (a duplicated
        // `containers:` drops a list); the API server's strict validation refuses it too.
        let mut seen = std::collections::HashSet::new();
        while let Some(key) = map.next_key_seed(MapKey(self))? {
            if let Some(k) = key
                && !seen.insert(k.clone())
            {
                return Err(de::Error::custom(format!(
                    "duplicate key {k:?} in one mapping; keep one (the second would replace the first)"
                )));
            }
            map.next_value_seed(self)?;
        }
        Ok(())
    }

    /// A value with a custom tag (`!name value`): the tag and the value.
    fn visit_enum<A: de::EnumAccess<'de>>(self, data: A) -> Result<(), A::Error> {
        use de::VariantAccess;
        self.add(1)?;
        let ((), variant) = data.variant_seed(self)?;
        variant.newtype_variant_seed(self)
    }
}

/// Scans `text` as libyaml's scanner does, far enough to follow the depth of flow collections.
/// Returns the deepest level reached, or the line and column (from 1) of the bracket that
/// opens level `max + 1`.
fn flow_depth(text: &str, max: usize) -> Result<usize, (usize, usize)> {
    let mut s = Scan {
        b: text.as_bytes(),
        pos: 0,
        line: 0,
        column: 0,
        index: 0,
        flow: 0,
        deepest: 0,
        indent: -1,
        indents: Vec::new(),
        allowed: true,
        key: None,
    };
    match s.run(max) {
        Ok(()) | Err(Stop::Libyaml) => Ok(s.deepest),
        Err(Stop::TooDeep) => Err((s.line + 1, s.column + 1)),
    }
}

/// Why the pre-scan ended early.
enum Stop {
    /// libyaml stops with an error here; nothing after this point is scanned.
    Libyaml,
    /// A flow collection opens one level deeper than allowed (at the current position).
    TooDeep,
}

/// A possible simple key (`key: value` on one line) at flow level 0, as libyaml keeps it: it
/// decides where a block mapping starts, and so the indentation block scalars and plain
/// scalars continue by.
#[derive(Clone, Copy)]
struct Key {
    line: usize,
    index: usize,
    column: i64,
    /// At the mapping's own indentation: a `:` must follow, or libyaml fails.
    required: bool,
}

/// The scanner's state, mirroring libyaml's (`unsafe-libyaml`'s `scanner.rs`): positions count
/// characters, as libyaml's marks do.
struct Scan<'a> {
    b: &'a [u8],
    pos: usize,
    line: usize,
    column: usize,
    index: usize,
    flow: usize,
    deepest: usize,
    /// The current block indentation (-1 outside any block collection) and the enclosing ones.
    indent: i64,
    indents: Vec<i64>,
    /// Whether a simple key may start here.
    allowed: bool,
    key: Option<Key>,
}

type Step = Result<(), Stop>;

impl Scan<'_> {
    fn at(&self, i: usize) -> u8 {
        self.b.get(self.pos + i).copied().unwrap_or(0)
    }

    fn eof(&self, i: usize) -> bool {
        self.pos + i >= self.b.len()
    }

    /// Bytes of the line break at offset `i` (0 when there is none): LF, CR, CRLF, NEL, LS, PS.
    fn brk(&self, i: usize) -> usize {
        match (self.at(i), self.at(i + 1), self.at(i + 2)) {
            (b'\r', b'\n', _) => 2,
            (b'\r' | b'\n', ..) => 1,
            (0xC2, 0x85, _) => 2,
            (0xE2, 0x80, 0xA8 | 0xA9) => 3,
            _ => 0,
        }
    }

    fn blank(&self, i: usize) -> bool {
        matches!(self.at(i), b' ' | b'\t') && !self.eof(i)
    }

    fn blankz(&self, i: usize) -> bool {
        self.eof(i) || self.blank(i) || self.brk(i) > 0
    }

    fn breakz(&self, i: usize) -> bool {
        self.eof(i) || self.brk(i) > 0
    }

    /// Moves past one character.
    fn skip(&mut self) {
        let width = match self.at(0) {
            0xF0.. => 4,
            0xE0.. => 3,
            0xC0.. => 2,
            _ => 1,
        };
        self.pos = (self.pos + width).min(self.b.len());
        self.column += 1;
        self.index += 1;
    }

    /// Moves past the line break here.
    fn skip_line(&mut self) {
        let n = self.brk(0);
        self.index += if n == 2 && self.at(0) == b'\r' { 2 } else { 1 };
        self.pos += n;
        self.column = 0;
        self.line += 1;
    }

    fn document_indicator(&self) -> bool {
        self.column == 0
            && (self.b[self.pos..].starts_with(b"---") || self.b[self.pos..].starts_with(b"..."))
            && self.blankz(3)
    }

    fn col(&self) -> i64 {
        i64::try_from(self.column).unwrap_or(i64::MAX)
    }

    fn roll(&mut self, column: i64) {
        if self.flow == 0 && self.indent < column {
            self.indents.push(self.indent);
            self.indent = column;
        }
    }

    fn unroll(&mut self, column: i64) {
        if self.flow == 0 {
            while self.indent > column {
                self.indent = self.indents.pop().unwrap_or(-1);
            }
        }
    }

    /// libyaml's `save_simple_key`; only level 0's key matters here.
    fn save_key(&mut self) -> Step {
        if self.flow == 0 && self.allowed {
            self.remove_key()?;
            let required = self.indent == self.col();
            self.key =
                Some(Key { line: self.line, index: self.index, column: self.col(), required });
        }
        Ok(())
    }

    /// libyaml's `remove_simple_key`: fails on a required key.
    fn remove_key(&mut self) -> Step {
        if self.flow == 0 && self.key.take().is_some_and(|k| k.required) {
            return Err(Stop::Libyaml);
        }
        Ok(())
    }

    fn run(&mut self, max: usize) -> Step {
        loop {
            self.skip_to_next_token();
            // libyaml's stale_simple_keys: a key must end on its line, within 1024 characters.
            if let Some(k) = self.key
                && (k.line < self.line || k.index + 1024 < self.index)
            {
                if k.required {
                    return Err(Stop::Libyaml);
                }
                self.key = None;
            }
            self.unroll(self.col());
            if self.eof(0) {
                return Ok(());
            }
            let c = self.at(0);
            if self.column == 0 && c == b'%' {
                // A directive: its line.
                self.unroll(-1);
                self.remove_key()?;
                self.allowed = false;
                while !self.breakz(0) {
                    self.skip();
                }
                continue;
            }
            if self.document_indicator() {
                self.unroll(-1);
                self.remove_key()?;
                self.allowed = false;
                self.pos += 3;
                self.column += 3;
                self.index += 3;
                continue;
            }
            match c {
                b'[' | b'{' => {
                    self.save_key()?;
                    if self.flow == max {
                        return Err(Stop::TooDeep);
                    }
                    self.flow += 1;
                    self.deepest = self.deepest.max(self.flow);
                    self.allowed = true;
                    self.skip();
                }
                b']' | b'}' => {
                    self.remove_key()?;
                    self.flow = self.flow.saturating_sub(1);
                    self.allowed = false;
                    self.skip();
                }
                b',' => {
                    self.remove_key()?;
                    self.allowed = true;
                    self.skip();
                }
                b'-' if self.blankz(1) => {
                    if self.flow == 0 {
                        if !self.allowed {
                            return Err(Stop::Libyaml);
                        }
                        self.roll(self.col());
                    }
                    self.remove_key()?;
                    self.allowed = true;
                    self.skip();
                }
                b'?' if self.flow > 0 || self.blankz(1) => {
                    if self.flow == 0 {
                        if !self.allowed {
                            return Err(Stop::Libyaml);
                        }
                        self.roll(self.col());
                    }
                    self.remove_key()?;
                    self.allowed = self.flow == 0;
                    self.skip();
                }
                b':' if self.flow > 0 || self.blankz(1) => {
                    if self.flow > 0 {
                        self.allowed = false;
                    } else if let Some(k) = self.key.take() {
                        self.roll(k.column);
                        self.allowed = false;
                    } else {
                        if !self.allowed {
                            return Err(Stop::Libyaml);
                        }
                        self.roll(self.col());
                        self.allowed = true;
                    }
                    self.skip();
                }
                b'*' | b'&' => {
                    self.save_key()?;
                    self.allowed = false;
                    self.anchor()?;
                }
                b'!' => {
                    self.save_key()?;
                    self.allowed = false;
                    self.tag()?;
                }
                b'|' | b'>' if self.flow == 0 => {
                    self.remove_key()?;
                    self.allowed = true;
                    self.block_scalar()?;
                }
                b'\'' | b'"' => {
                    self.save_key()?;
                    self.allowed = false;
                    self.quoted(c == b'\'')?;
                }
                _ if self.plain_starts() => {
                    self.save_key()?;
                    self.allowed = false;
                    self.plain()?;
                }
                _ => return Err(Stop::Libyaml),
            }
        }
    }

    /// Past spaces, comments and line breaks (libyaml's `scan_to_next_token`).
    fn skip_to_next_token(&mut self) {
        loop {
            if self.column == 0 && self.b[self.pos..].starts_with("\u{feff}".as_bytes()) {
                self.skip();
            }
            while self.at(0) == b' '
                || (self.flow > 0 || !self.allowed) && self.at(0) == b'\t' && !self.eof(0)
            {
                self.skip();
            }
            if self.at(0) == b'#' {
                while !self.breakz(0) {
                    self.skip();
                }
            }
            if self.brk(0) == 0 {
                return;
            }
            self.skip_line();
            if self.flow == 0 {
                self.allowed = true;
            }
        }
    }

    fn anchor(&mut self) -> Step {
        self.skip();
        let mut n = 0;
        while self.at(0).is_ascii_alphanumeric() || matches!(self.at(0), b'_' | b'-') {
            self.skip();
            n += 1;
        }
        if n == 0 || !(self.blankz(0) || b"?:,]}%@`".contains(&self.at(0))) {
            return Err(Stop::Libyaml);
        }
        Ok(())
    }

    fn tag(&mut self) -> Step {
        let uri = |c: u8, verbatim: bool| {
            c.is_ascii_alphanumeric()
                || b"_-;/?:@&=+$.%!~*'()".contains(&c)
                || verbatim && b",[]".contains(&c)
        };
        if self.at(1) == b'<' {
            self.skip();
            self.skip();
            while uri(self.at(0), true) {
                self.skip();
            }
            if self.at(0) != b'>' {
                return Err(Stop::Libyaml);
            }
            self.skip();
        } else {
            // `!`, `!!` or `!handle!`, then the suffix: all URI characters.
            self.skip();
            while uri(self.at(0), false) {
                self.skip();
            }
        }
        if !(self.blankz(0) || self.flow > 0 && self.at(0) == b',') {
            return Err(Stop::Libyaml);
        }
        Ok(())
    }

    /// A literal or folded block scalar: its header line, then every line indented at least
    /// as far as its content (libyaml's `scan_block_scalar` and `scan_block_scalar_breaks`).
    fn block_scalar(&mut self) -> Step {
        self.skip();
        // The header: chomping (`+`, `-`) and indentation (1 to 9) indicators, in either order.
        let mut increment = 0;
        let chomping_first = matches!(self.at(0), b'+' | b'-');
        if chomping_first {
            self.skip();
        }
        if self.at(0) == b'0' {
            return Err(Stop::Libyaml);
        }
        if self.at(0).is_ascii_digit() {
            increment = i64::from(self.at(0) - b'0');
            self.skip();
            if !chomping_first && matches!(self.at(0), b'+' | b'-') {
                self.skip();
            }
        }
        while self.blank(0) {
            self.skip();
        }
        if self.at(0) == b'#' {
            while !self.breakz(0) {
                self.skip();
            }
        }
        if !self.breakz(0) {
            return Err(Stop::Libyaml);
        }
        if self.brk(0) > 0 {
            self.skip_line();
        }
        let mut indent = match increment {
            0 => 0,
            n if self.indent >= 0 => self.indent + n,
            n => n,
        };
        self.block_breaks(&mut indent)?;
        while self.col() == indent && !self.eof(0) {
            while !self.breakz(0) {
                self.skip();
            }
            if self.brk(0) > 0 {
                self.skip_line();
            }
            self.block_breaks(&mut indent)?;
        }
        Ok(())
    }

    fn block_breaks(&mut self, indent: &mut i64) -> Step {
        let mut max_indent = 0;
        loop {
            while (*indent == 0 || self.col() < *indent) && self.at(0) == b' ' && !self.eof(0) {
                self.skip();
            }
            max_indent = max_indent.max(self.col());
            if (*indent == 0 || self.col() < *indent) && self.at(0) == b'\t' && !self.eof(0) {
                return Err(Stop::Libyaml);
            }
            if self.brk(0) == 0 {
                break;
            }
            self.skip_line();
        }
        if *indent == 0 {
            *indent = max_indent.max(self.indent + 1).max(1);
        }
        Ok(())
    }

    /// A single- or double-quoted scalar, over as many lines as it takes.
    fn quoted(&mut self, single: bool) -> Step {
        self.skip();
        loop {
            if self.document_indicator() || self.eof(0) {
                return Err(Stop::Libyaml);
            }
            match self.at(0) {
                b'\'' if single && self.at(1) == b'\'' => {
                    self.skip();
                    self.skip();
                }
                b'\'' if single => {
                    self.skip();
                    return Ok(());
                }
                b'"' if !single => {
                    self.skip();
                    return Ok(());
                }
                b'\\' if !single => {
                    self.skip();
                    if self.brk(0) > 0 {
                        self.skip_line();
                    } else if !self.eof(0) {
                        self.skip();
                    }
                }
                _ if self.brk(0) > 0 => self.skip_line(),
                _ => self.skip(),
            }
        }
    }

    /// libyaml's test for a character that starts a plain scalar.
    fn plain_starts(&self) -> bool {
        let c = self.at(0);
        !(self.blankz(0) || b"-?:,[]{}#&*!|>'\"%@`".contains(&c))
            || c == b'-' && !self.blank(1)
            || self.flow == 0 && matches!(c, b'?' | b':') && !self.blankz(1)
    }

    /// A plain scalar: to `: `, ` #`, a flow indicator in flow context, or (in block context) a
    /// line indented no deeper than the current block (libyaml's `scan_plain_scalar`).
    fn plain(&mut self) -> Step {
        let indent = self.indent + 1;
        let mut leading_blanks = false;
        loop {
            if self.document_indicator() || self.at(0) == b'#' {
                break;
            }
            while !self.blankz(0) {
                let c = self.at(0);
                if self.flow > 0 && c == b':' && b",?[]{}".contains(&self.at(1)) {
                    return Err(Stop::Libyaml);
                }
                if c == b':' && self.blankz(1) || self.flow > 0 && b",[]{}".contains(&c) {
                    break;
                }
                leading_blanks = false;
                self.skip();
            }
            if !(self.blank(0) || self.brk(0) > 0) {
                break;
            }
            while self.blank(0) || self.brk(0) > 0 {
                if self.blank(0) {
                    if leading_blanks && self.col() < indent && self.at(0) == b'\t' {
                        return Err(Stop::Libyaml);
                    }
                    self.skip();
                } else {
                    self.skip_line();
                    leading_blanks = true;
                }
            }
            if self.flow == 0 && self.col() < indent {
                break;
            }
        }
        if leading_blanks {
            self.allowed = true;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use serde_json::Value;

    /// One anchored scalar of `size` bytes and `n` aliases of it in a list.
    fn alias_bomb(size: usize, n: usize) -> String {
        let mut s = format!("a: &x {}\nenv:\n", "y".repeat(size));
        for _ in 0..n {
            s.push_str("- *x\n");
        }
        s
    }

    #[test]
    fn plain_documents_load() {
        let docs: Vec<Value> = load("a: 1\n---\nb: [x, {c: d}]\n", "t").unwrap();
        assert_eq!(
            docs,
            vec![serde_json::json!({"a": 1}), serde_json::json!({"b": ["x", {"c": "d"}]})]
        );
        let empty: Value = load_one("", "t").unwrap();
        assert_eq!(empty, Value::Null);
    }

    #[test]
    fn modest_anchors_load() {
        // A shared block used a few times, as manifests do.
        let y = "base: &b {cpu: 1, memory: 2Gi, note: some words here}\nx: *b\ny: *b\nz: *b\n";
        let v: Value = load_one(y, "t").unwrap();
        assert_eq!(v["z"]["memory"], "2Gi");
        // Past the floor, but within 4 times the input: the scalar and two copies.
        load::<Value>(&alias_bomb(40_000, 2), "t").unwrap();
    }

    #[test]
    fn alias_amplification_is_refused_with_the_limit() {
        // The case: a 10 KB scalar and 20,000 aliases, 259 KB expanding to 200 MB.
        let bomb = alias_bomb(10_000, 20_000);
        let e = load::<Value>(&bomb, "manifest").unwrap_err();
        let limit = bomb.len() * EXPANSION_FACTOR;
        assert_eq!(e.problem, Problem::Expansion { limit, len: bomb.len() });
        let text = e.to_string();
        assert!(text.starts_with("manifest: expands to more than"), "{text}");
        assert!(text.contains("remove the aliases"), "{text}");
    }

    #[test]
    fn nested_aliases_are_counted_as_copies() {
        // Billion laughs: each level doubles ten times; 10^9 leaves from a few hundred bytes.
        let mut y = String::from("l0: &l0 [x, x, x, x, x, x, x, x, x, x]\n");
        for i in 1..9 {
            let p = i - 1;
            y.push_str(&format!(
                "l{i}: &l{i} [*l{p}, *l{p}, *l{p}, *l{p}, *l{p}, *l{p}, *l{p}, *l{p}, *l{p}, *l{p}]\n"
            ));
        }
        let e = load::<Value>(&y, "bomb.yaml").unwrap_err();
        assert!(matches!(e.problem, Problem::Expansion { limit: MIN_EXPANSION_LIMIT, .. }), "{e}");
        // Any target type, the same check: serde_norway's own Value too.
        let e = load_one::<serde_norway::Value>(&y, "bomb.yaml").unwrap_err();
        assert!(matches!(e.problem, Problem::Expansion { .. }), "{e}");
    }

    #[test]
    fn deep_flow_nesting_is_refused_before_parsing() {
        // The body: 120 KB of nested brackets, seconds of libyaml's time.
        let deep = format!("a: {}{}\n", "[".repeat(60_000), "]".repeat(60_000));
        let e = load::<Value>(&deep, "manifest").unwrap_err();
        assert_eq!(e.problem, Problem::TooDeep { line: 1, column: 4 + MAX_FLOW_DEPTH });
        assert!(e.to_string().starts_with("manifest: nests flow collections"), "{e}");
        // One line per level, mappings: the same.
        let deep = format!("a: {}1{}\n", "{b:\n".repeat(1_000), "}".repeat(1_000));
        let e = load::<Value>(&deep, "m").unwrap_err();
        assert_eq!(e.problem, Problem::TooDeep { line: 1 + MAX_FLOW_DEPTH, column: 1 });
        // At the limit it loads.
        let at = format!("a: {}{}\n", "[".repeat(MAX_FLOW_DEPTH), "]".repeat(MAX_FLOW_DEPTH));
        load::<Value>(&at, "m").unwrap();
    }

    #[test]
    fn brackets_in_text_do_not_count() {
        let open = "[".repeat(100);
        for y in [
            format!("a: \"{open}\"\n"),
            format!("a: '{open}'\n"),
            format!("a: x{open}\n"),
            format!("a: x\n  {open}\n"),
            format!("a: 1 # {open}\n"),
            format!("# {open}\na: 1\n"),
            format!("a: |\n  {open}\n  more {open}\nb: 2\n"),
            format!("- a: >-\n    {open}\n\n    {open}\n  b: 2\n"),
            format!("a: |2\n   {open}\nb: 2\n"),
            format!("a: \"x\n  {open}\n  \"\n"),
            format!("a: [\"{open}\", '{open}', x]\n"),
            format!("a: !t{open}x\n").replace('[', "("),
            format!("a: |\r\n  {open}\r\nb: 2\r\n"),
        ] {
            assert_eq!(
                flow_depth(&y, MAX_FLOW_DEPTH),
                Ok(usize::from(y.contains("a: [\""))),
                "{y:?}"
            );
            load::<serde_norway::Value>(&y, "t").unwrap();
        }
    }

    #[test]
    fn nesting_after_tricky_text_still_counts() {
        // Valid YAML whose real nesting follows text that could hide it from a careless scan:
        // each must count every level.
        for (y, depth) in [
            ("a: |\n  x \"\nb: [[[x]]]\n", 3),
            ("- a: |\n    x\n  b: [[[x]]]\n", 3),
            ("a: x\n  \"\nb: [[[x]]]\n", 3),
            ("a: 'it''s [['\nb: [[[x]]]\n", 3),
            ("a: \"\\\" [[\"\nb: [[[x]]]\n", 3),
            ("a: x # \"[[\nb: [[[x]]]\n", 3),
            ("a: x\"[[\nb: [[[x]]]\n", 3),
            ("a: [x\"y, [[[x]]]]\n", 4),
            ("a: [!t, [[[x]]]]\n", 4),
            ("a: \"x\n  ]]]]\n  \"\nb: [[[x]]]\n", 3),
            ("a: |2\n   x\nb: [[[x]]]\n", 3),
            ("a: >-\r\n  ]]]\r\n\r\n  ]]\r\nb: {c: [[d]]}\r\n", 3),
            ("&k a: [[x]]\n", 2),
            ("? [[a]]\n: [[[b]]]\n", 3),
            ("a: b\n---\n[[[x]]]\n", 3),
            ("\u{feff}a: [[x]]\n", 2),
            ("a: [x, {b: [c, [d]]}]\n", 4),
        ] {
            assert_eq!(flow_depth(y, MAX_FLOW_DEPTH), Ok(depth), "{y:?}");
            load::<serde_norway::Value>(y, "t").unwrap();
        }
    }

    /// Strings full of YAML's indicators and line breaks.
    fn tricky_string() -> impl proptest::strategy::Strategy<Value = String> {
        use proptest::prelude::*;
        let chars =
            prop::sample::select("[]{}\"'#:,-?|>!&*%@`\\ \t\naé".chars().collect::<Vec<_>>());
        prop::collection::vec(chars, 0..12).prop_map(|v| v.into_iter().collect())
    }

    fn tree() -> impl proptest::strategy::Strategy<Value = Value> {
        use proptest::prelude::*;
        let leaf = prop_oneof![
            tricky_string().prop_map(Value::String),
            any::<i32>().prop_map(Value::from),
            Just(Value::Null),
        ];
        leaf.prop_recursive(6, 48, 4, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
                prop::collection::btree_map(tricky_string(), inner, 0..4)
                    .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
    }

    fn depth(v: &Value) -> usize {
        match v {
            Value::Array(a) => 1 + a.iter().map(depth).max().unwrap_or(0),
            Value::Object(m) => 1 + m.values().map(depth).max().unwrap_or(0),
            _ => 0,
        }
    }

    proptest::proptest! {
        /// JSON is flow YAML: its nesting is exactly the flow depth, whatever the strings hold.
        #[test]
        fn flow_depth_of_json_is_its_nesting(v in tree()) {
            let y = format!("a: {}\n", serde_json::to_string(&v).unwrap());
            proptest::prop_assert_eq!(flow_depth(&y, usize::MAX), Ok(depth(&v)));
        }

        /// serde_norway writes block style: at most `[]` or `{}` for empty collections, however
        /// many brackets its scalars hold.
        #[test]
        fn block_yaml_has_no_flow_depth(v in tree()) {
            let y = serde_norway::to_string(&v).unwrap();
            proptest::prop_assert!(flow_depth(&y, usize::MAX).unwrap() <= 1, "{}", y);
            proptest::prop_assert_eq!(load_one::<Value>(&y, "t").unwrap(), v);
        }

        /// Flow values inside block YAML, among scalars of every style: the flow depth is the
        /// deepest flow value's nesting.
        #[test]
        fn flow_inside_block_counts_exactly(outer in tree(), inner in tree()) {
            // Put the flow value where a leaf `FLOW` is (keys never spell it).
            let mut outer = outer;
            fn plant(v: &mut Value) -> bool {
                match v {
                    Value::Array(a) => a.iter_mut().any(plant),
                    Value::Object(m) => m.values_mut().any(plant),
                    leaf => {
                        *leaf = Value::from("FLOW");
                        true
                    }
                }
            }
            plant(&mut outer);
            let block = serde_norway::to_string(&outer).unwrap();
            let planted = block.contains("FLOW");
            let y = block.replace("FLOW", &serde_json::to_string(&inner).unwrap());
            let got = flow_depth(&y, usize::MAX).unwrap();
            let want = if planted { depth(&inner) } else { 0 };
            proptest::prop_assert!(got >= want && got <= want.max(1), "{} for {}", got, y);
            proptest::prop_assert!(load_one::<Value>(&y, "t").is_ok(), "{}", y);
        }
    }

    #[test]
    fn errors_keep_serde_norways_message() {
        let e = load::<Value>("a: [unclosed\n", "m").unwrap_err();
        assert!(matches!(e.problem, Problem::Invalid(_)), "{e}");
        assert!(e.to_string().starts_with("m: invalid YAML: "), "{e}");
        let e = load_one::<Value>("a: 1\n---\nb: 2\n", "m").unwrap_err();
        assert_eq!(e.problem, Problem::Documents(2));
    }
}
