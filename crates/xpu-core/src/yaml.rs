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

use std::cell::Cell;
use std::fmt;

use serde::de::{self, DeserializeOwned, DeserializeSeed, Visitor};

/// The expanded size may be this many times the input's size.
pub const EXPANSION_FACTOR: usize = 4;
/// The expanded size is always allowed up to this many bytes, whatever the input's size.
pub const MIN_EXPANSION_LIMIT: usize = 64 * 1024;

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
}

/// The most bytes `text` may expand to (see the module docs).
pub fn expansion_limit(text: &str) -> usize {
    text.len().saturating_mul(EXPANSION_FACTOR).max(MIN_EXPANSION_LIMIT)
}

/// Loads every document of `text` as a `T`, within the limits of this module; `what` names the
/// input in errors.
pub fn load<T: DeserializeOwned>(text: &str, what: &str) -> Result<Vec<T>, YamlError> {
    let fail = |problem| YamlError { what: what.to_owned(), problem };
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
        while map.next_key_seed(self)?.is_some() {
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
    fn errors_keep_serde_norways_message() {
        let e = load::<Value>("a: [unclosed\n", "m").unwrap_err();
        assert!(matches!(e.problem, Problem::Invalid(_)), "{e}");
        assert!(e.to_string().starts_with("m: invalid YAML: "), "{e}");
        let e = load_one::<Value>("a: 1\n---\nb: 2\n", "m").unwrap_err();
        assert_eq!(e.problem, Problem::Documents(2));
    }
}
