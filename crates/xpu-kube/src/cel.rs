//! CEL for DRA device selectors: a parser and an evaluator of the part of CEL that DRA's
//! environment offers (Kubernetes 1.37), bounded in size, depth and steps, since a selector is
//! tenant input.
//!
//! - **Syntax**: literals (int, uint `1u`, double, string with escapes, raw strings, bool,
//!   null), lists, maps, `.field`, `[index]`, optional `.?field` and `[?index]`, calls and
//!   methods, `! - * / % + - < <= > >= == != in && || ?:`.
//! - **Macros**: `has(x.f)`, `all`, `exists`, `exists_one`, `map`, `filter`, `cel.bind`.
//! - **Functions**: `size`, `contains`, `startsWith`, `endsWith`, `matches`, `lowerAscii`,
//!   `upperAscii`, `int`, `uint`, `double`, `string`, `includes`, optional `orValue`,
//!   `hasValue`, `value`; Kubernetes' quantity library (`quantity`, `isQuantity`, `compareTo`,
//!   `isGreaterThan`, `isLessThan`, `add`, `sub`, `asInteger`, `isInteger`, `asApproximateFloat`,
//!   `sign`) and semver library (`semver`, `isSemver`, `compareTo`, `isGreaterThan`,
//!   `isLessThan`, `major`, `minor`, `patch`).
//! - **Bounds**: at most [`MAX_LEN`] bytes (the API's own limit), nesting at most [`MAX_DEPTH`]
//!   deep (checked while parsing, so a deep text never recurses far), and each evaluation at
//!   most [`MAX_STEPS`] steps, every node, comprehension round and string byte counted (the API
//!   server's cost limit is 1,000,000 estimated steps).
//!
//! `&&` and `||` commute over errors as CEL's do: `false && error` is false, `true || error` is
//! true, whichever side the error is on.

use std::collections::BTreeMap;
use std::sync::Arc;

/// The longest expression accepted (the API server's limit for DRA selectors).
pub const MAX_LEN: usize = 10 * 1024;
/// The deepest nesting accepted.
pub const MAX_DEPTH: usize = 100;
/// Steps one evaluation may take.
pub const MAX_STEPS: u64 = 1_000_000;

/// A CEL value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    Null,
    Bool(bool),
    Int(i64),
    Uint(u64),
    Double(f64),
    String(Arc<str>),
    List(Arc<Vec<Value>>),
    Map(Arc<BTreeMap<Key, Value>>),
    /// `device.attributes` and `device.capacity`: a map by domain where a domain the device
    /// does not have reads as an empty map.
    Domains(Arc<BTreeMap<Key, Value>>),
    /// A Kubernetes quantity, in billionths.
    Quantity(i128),
    Semver(Arc<Semver>),
    Optional(Option<Box<Value>>),
}

/// A map key.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub enum Key {
    Bool(bool),
    Int(i64),
    Uint(u64),
    String(Arc<str>),
}

/// A semantic version.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Semver {
    pub major: u64,
    pub minor: u64,
    pub patch: u64,
    pub pre: Vec<String>,
}

impl Semver {
    /// `MAJOR.MINOR.PATCH[-PRE][+BUILD]`, strictly.
    pub fn parse(s: &str) -> Option<Semver> {
        let core = s.split('+').next()?;
        let (nums, pre) = match core.split_once('-') {
            Some((n, p)) => (n, p.split('.').map(str::to_owned).collect::<Vec<_>>()),
            None => (core, Vec::new()),
        };
        if pre.iter().any(|p| p.is_empty()) {
            return None;
        }
        let mut parts = nums.split('.');
        let mut num = || {
            let p = parts.next()?;
            if p.is_empty() || (p.len() > 1 && p.starts_with('0')) {
                return None;
            }
            p.parse().ok()
        };
        let v = Semver { major: num()?, minor: num()?, patch: num()?, pre };
        parts.next().is_none().then_some(v)
    }

    fn cmp(&self, o: &Semver) -> std::cmp::Ordering {
        use std::cmp::Ordering;
        (self.major, self.minor, self.patch).cmp(&(o.major, o.minor, o.patch)).then_with(|| match (
            self.pre.is_empty(),
            o.pre.is_empty(),
        ) {
            (true, true) => Ordering::Equal,
            (true, false) => Ordering::Greater,
            (false, true) => Ordering::Less,
            (false, false) => {
                for (a, b) in self.pre.iter().zip(&o.pre) {
                    let c = match (a.parse::<u64>(), b.parse::<u64>()) {
                        (Ok(x), Ok(y)) => x.cmp(&y),
                        (Ok(_), Err(_)) => Ordering::Less,
                        (Err(_), Ok(_)) => Ordering::Greater,
                        (Err(_), Err(_)) => a.cmp(b),
                    };
                    if c != Ordering::Equal {
                        return c;
                    }
                }
                self.pre.len().cmp(&o.pre.len())
            }
        })
    }
}

/// A quantity in billionths, as Kubernetes writes them (`1.5Gi`, `500m`, `1e3`).
pub fn parse_quantity(s: &str) -> Option<i128> {
    let s = s.trim();
    if s.is_empty() || s.len() > 64 {
        return None;
    }
    let (neg, s) = match s.as_bytes()[0] {
        b'-' => (true, &s[1..]),
        b'+' => (false, &s[1..]),
        _ => (false, s),
    };
    let end = s.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(s.len());
    let (num, suffix) = s.split_at(end);
    if num.is_empty() || num == "." || num.matches('.').count() > 1 {
        return None;
    }
    let (whole, frac) = num.split_once('.').unwrap_or((num, ""));
    // value = digits × 10^(−frac digits); work in billionths.
    let digits: i128 = format!("{whole}{frac}").parse().ok()?;
    let mut exp10: i32 = 9 - i32::try_from(frac.len()).ok()?;
    let mut mul2: u32 = 0;
    match suffix {
        "" => {}
        "n" => exp10 -= 9,
        "u" => exp10 -= 6,
        "m" => exp10 -= 3,
        "k" => exp10 += 3,
        "M" => exp10 += 6,
        "G" => exp10 += 9,
        "T" => exp10 += 12,
        "P" => exp10 += 15,
        "E" => exp10 += 18,
        "Ki" => mul2 = 10,
        "Mi" => mul2 = 20,
        "Gi" => mul2 = 30,
        "Ti" => mul2 = 40,
        "Pi" => mul2 = 50,
        "Ei" => mul2 = 60,
        e if e.starts_with(['e', 'E']) => exp10 += e[1..].parse::<i32>().ok()?,
        _ => return None,
    }
    let mut v = digits.checked_mul(1i128.checked_shl(mul2)?)?;
    if exp10 >= 0 {
        v = v.checked_mul(10i128.checked_pow(u32::try_from(exp10).ok()?)?)?;
    } else {
        // Below a billionth rounds up, as Kubernetes rounds quantities up.
        let d = 10i128.checked_pow(u32::try_from(-exp10).ok()?)?;
        v = (v + d - 1) / d;
    }
    Some(if neg { -v } else { v })
}

/// A parse or evaluation error.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Error(pub String);

fn err<T>(msg: impl Into<String>) -> Result<T, Error> {
    Err(Error(msg.into()))
}

#[derive(Debug, Clone, PartialEq)]
enum Tok {
    Int(i64),
    Uint(u64),
    Double(f64),
    Str(String),
    Ident(String),
    Op(&'static str),
}

fn lex(src: &str) -> Result<Vec<(Tok, usize)>, Error> {
    let b = src.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    const OPS: [&str; 25] = [
        "&&", "||", "==", "!=", "<=", ">=", ".?", "[?", "<", ">", "!", "+", "-", "*", "/", "%",
        "?", ":", ".", ",", "(", ")", "[", "]", "{",
    ];
    while i < b.len() {
        let c = b[i];
        if c.is_ascii_whitespace() {
            i += 1;
            continue;
        }
        if c == b'/' && b.get(i + 1) == Some(&b'/') {
            while i < b.len() && b[i] != b'\n' {
                i += 1;
            }
            continue;
        }
        let at = i;
        if c.is_ascii_digit() || (c == b'.' && b.get(i + 1).is_some_and(u8::is_ascii_digit)) {
            let hex = c == b'0' && matches!(b.get(i + 1), Some(b'x' | b'X'));
            if hex {
                i += 2;
            }
            let start = i;
            let mut double = false;
            while i < b.len() {
                let d = b[i];
                if d.is_ascii_digit() || (hex && d.is_ascii_hexdigit()) {
                    i += 1;
                } else if !hex && d == b'.' && b.get(i + 1).is_some_and(u8::is_ascii_digit) {
                    double = true;
                    i += 1;
                } else if !hex && (d == b'e' || d == b'E') {
                    double = true;
                    i += 1;
                    if matches!(b.get(i), Some(b'+' | b'-')) {
                        i += 1;
                    }
                } else {
                    break;
                }
            }
            let text = &src[start..i];
            let unsigned = matches!(b.get(i), Some(b'u' | b'U'));
            if unsigned {
                i += 1;
            }
            let tok = if double {
                Tok::Double(text.parse().map_err(|_| Error(format!("bad number at {at}")))?)
            } else {
                let v = u64::from_str_radix(text, if hex { 16 } else { 10 })
                    .map_err(|_| Error(format!("number out of range at {at}")))?;
                if unsigned {
                    Tok::Uint(v)
                } else {
                    Tok::Int(
                        i64::try_from(v).map_err(|_| Error(format!("int out of range at {at}")))?,
                    )
                }
            };
            out.push((tok, at));
            continue;
        }
        let raw = (c == b'r' || c == b'R') && matches!(b.get(i + 1), Some(b'"' | b'\''));
        if c == b'"' || c == b'\'' || raw {
            if raw {
                i += 1;
            }
            let q = b[i];
            let triple = b.get(i + 1) == Some(&q) && b.get(i + 2) == Some(&q);
            i += if triple { 3 } else { 1 };
            let mut s = String::new();
            loop {
                let Some(&d) = b.get(i) else { return err(format!("unterminated string at {at}")) };
                if d == q && (!triple || (b.get(i + 1) == Some(&q) && b.get(i + 2) == Some(&q))) {
                    i += if triple { 3 } else { 1 };
                    break;
                }
                if d == b'\n' && !triple {
                    return err(format!("unterminated string at {at}"));
                }
                if d == b'\\' && !raw {
                    let e = *b.get(i + 1).ok_or_else(|| Error(format!("bad escape at {i}")))?;
                    i += 2;
                    match e {
                        b'n' => s.push('\n'),
                        b't' => s.push('\t'),
                        b'r' => s.push('\r'),
                        b'\\' | b'"' | b'\'' | b'`' | b'?' => s.push(char::from(e)),
                        b'u' | b'x' | b'U' => {
                            let n = match e {
                                b'x' => 2,
                                b'u' => 4,
                                _ => 8,
                            };
                            let hex = src
                                .get(i..i + n)
                                .ok_or_else(|| Error(format!("bad escape at {i}")))?;
                            let v = u32::from_str_radix(hex, 16)
                                .map_err(|_| Error(format!("bad escape at {i}")))?;
                            s.push(
                                char::from_u32(v)
                                    .ok_or_else(|| Error(format!("bad escape at {i}")))?,
                            );
                            i += n;
                        }
                        _ => return err(format!("bad escape \\{} at {i}", char::from(e))),
                    }
                    continue;
                }
                let ch = src[i..].chars().next().unwrap_or('\u{fffd}');
                s.push(ch);
                i += ch.len_utf8();
            }
            out.push((Tok::Str(s), at));
            continue;
        }
        if c.is_ascii_alphabetic() || c == b'_' {
            while i < b.len() && (b[i].is_ascii_alphanumeric() || b[i] == b'_') {
                i += 1;
            }
            out.push((Tok::Ident(src[at..i].to_owned()), at));
            continue;
        }
        if c == b'}' {
            out.push((Tok::Op("}"), at));
            i += 1;
            continue;
        }
        match OPS.iter().find(|op| src[i..].starts_with(**op)) {
            Some(op) => {
                out.push((Tok::Op(op), at));
                i += op.len();
            }
            None => {
                return err(format!(
                    "unexpected character {:?} at {at}",
                    src[i..].chars().next().unwrap_or(' ')
                ));
            }
        }
    }
    Ok(out)
}

/// An expression.
#[derive(Debug, Clone, PartialEq)]
enum Expr {
    Lit(Value),
    Ident(String),
    Select(Box<Expr>, String, bool),
    Index(Box<Expr>, Box<Expr>, bool),
    Call(Option<Box<Expr>>, String, Vec<Expr>),
    List(Vec<Expr>),
    Map(Vec<(Expr, Expr)>),
    Unary(&'static str, Box<Expr>),
    Binary(&'static str, Box<Expr>, Box<Expr>),
    Cond(Box<Expr>, Box<Expr>, Box<Expr>),
}

struct Parser {
    toks: Vec<(Tok, usize)>,
    at: usize,
    depth: usize,
}

impl Parser {
    fn peek(&self) -> Option<&Tok> {
        self.toks.get(self.at).map(|t| &t.0)
    }

    fn is(&self, op: &str) -> bool {
        matches!(self.peek(), Some(Tok::Op(o)) if *o == op)
    }

    fn eat(&mut self, op: &str) -> bool {
        let yes = self.is(op);
        if yes {
            self.at += 1;
        }
        yes
    }

    fn pos(&self) -> String {
        self.toks.get(self.at).map_or_else(|| "the end".into(), |t| format!("offset {}", t.1))
    }

    fn expect(&mut self, op: &str) -> Result<(), Error> {
        if self.eat(op) { Ok(()) } else { err(format!("expected {op:?} at {}", self.pos())) }
    }

    fn enter(&mut self) -> Result<(), Error> {
        self.depth += 1;
        if self.depth > MAX_DEPTH {
            return err(format!("nests deeper than {MAX_DEPTH} levels at {}", self.pos()));
        }
        Ok(())
    }

    fn expr(&mut self) -> Result<Expr, Error> {
        self.enter()?;
        let c = self.or()?;
        let out = if self.eat("?") {
            let a = self.expr()?;
            self.expect(":")?;
            let b = self.expr()?;
            Expr::Cond(Box::new(c), Box::new(a), Box::new(b))
        } else {
            c
        };
        self.depth -= 1;
        Ok(out)
    }

    /// A left-associative chain; each operator is a level of nesting for the evaluator.
    fn binary(
        &mut self,
        ops: &[&'static str],
        next: fn(&mut Self) -> Result<Expr, Error>,
    ) -> Result<Expr, Error> {
        let mut l = next(self)?;
        let depth = self.depth;
        while let Some(op) = ops.iter().find(|o| self.is(o)) {
            self.at += 1;
            self.enter()?;
            let r = next(self)?;
            l = Expr::Binary(op, Box::new(l), Box::new(r));
        }
        self.depth = depth;
        Ok(l)
    }

    /// A chain of `&&` or `||`, built as a balanced tree (as cel-go does), so that a long
    /// disjunction is shallow.
    fn logical(
        &mut self,
        op: &'static str,
        next: fn(&mut Self) -> Result<Expr, Error>,
    ) -> Result<Expr, Error> {
        let mut terms = vec![next(self)?];
        while self.eat(op) {
            terms.push(next(self)?);
        }
        fn balance(op: &'static str, mut terms: Vec<Expr>) -> Expr {
            if terms.len() == 1 {
                return terms.remove(0);
            }
            let right = terms.split_off(terms.len() / 2);
            Expr::Binary(op, Box::new(balance(op, terms)), Box::new(balance(op, right)))
        }
        Ok(balance(op, terms))
    }

    fn or(&mut self) -> Result<Expr, Error> {
        self.logical("||", Self::and)
    }
    fn and(&mut self) -> Result<Expr, Error> {
        self.logical("&&", Self::rel)
    }
    fn rel(&mut self) -> Result<Expr, Error> {
        let mut l = self.add()?;
        let depth = self.depth;
        loop {
            let op = match self.peek() {
                Some(Tok::Op(o @ ("<" | "<=" | ">" | ">=" | "==" | "!="))) => *o,
                Some(Tok::Ident(w)) if w == "in" => "in",
                _ => break,
            };
            self.at += 1;
            self.enter()?;
            let r = self.add()?;
            l = Expr::Binary(op, Box::new(l), Box::new(r));
        }
        self.depth = depth;
        Ok(l)
    }
    fn add(&mut self) -> Result<Expr, Error> {
        self.binary(&["+", "-"], Self::mul)
    }
    fn mul(&mut self) -> Result<Expr, Error> {
        self.binary(&["*", "/", "%"], Self::unary)
    }
    fn unary(&mut self) -> Result<Expr, Error> {
        for op in ["!", "-"] {
            if self.eat(op) {
                self.enter()?;
                let e = self.unary()?;
                self.depth -= 1;
                return Ok(Expr::Unary(op, Box::new(e)));
            }
        }
        self.member()
    }

    fn args(&mut self, close: &str) -> Result<Vec<Expr>, Error> {
        let mut v = Vec::new();
        while !self.eat(close) {
            v.push(self.expr()?);
            if !self.eat(",") {
                self.expect(close)?;
                break;
            }
        }
        Ok(v)
    }

    fn member(&mut self) -> Result<Expr, Error> {
        let mut e = self.primary()?;
        let depth = self.depth;
        let out = loop {
            let optional = self.is(".?");
            if optional || self.is(".") {
                self.at += 1;
                let Some(Tok::Ident(name)) = self.peek().cloned() else {
                    return err(format!("expected a field name at {}", self.pos()));
                };
                self.at += 1;
                if !optional && self.eat("(") {
                    let args = self.args(")")?;
                    e = Expr::Call(Some(Box::new(e)), name, args);
                } else {
                    e = Expr::Select(Box::new(e), name, optional);
                }
            } else if self.is("[") || self.is("[?") {
                let optional = self.is("[?");
                self.at += 1;
                let i = self.expr()?;
                self.expect("]")?;
                e = Expr::Index(Box::new(e), Box::new(i), optional);
            } else {
                break e;
            }
            self.enter()?;
        };
        self.depth = depth;
        Ok(out)
    }

    fn primary(&mut self) -> Result<Expr, Error> {
        let Some((tok, _)) = self.toks.get(self.at).cloned() else {
            return err("unexpected end of expression");
        };
        self.at += 1;
        Ok(match tok {
            Tok::Int(v) => Expr::Lit(Value::Int(v)),
            Tok::Uint(v) => Expr::Lit(Value::Uint(v)),
            Tok::Double(v) => Expr::Lit(Value::Double(v)),
            Tok::Str(s) => Expr::Lit(Value::String(s.into())),
            Tok::Ident(w) => match w.as_str() {
                "true" => Expr::Lit(Value::Bool(true)),
                "false" => Expr::Lit(Value::Bool(false)),
                "null" => Expr::Lit(Value::Null),
                _ if self.eat("(") => Expr::Call(None, w, self.args(")")?),
                _ => Expr::Ident(w),
            },
            Tok::Op("(") => {
                let e = self.expr()?;
                self.expect(")")?;
                e
            }
            Tok::Op("[") => {
                self.enter()?;
                let v = self.args("]")?;
                self.depth -= 1;
                Expr::List(v)
            }
            Tok::Op("{") => {
                self.enter()?;
                let mut v = Vec::new();
                while !self.eat("}") {
                    let k = self.expr()?;
                    self.expect(":")?;
                    v.push((k, self.expr()?));
                    if !self.eat(",") {
                        self.expect("}")?;
                        break;
                    }
                }
                self.depth -= 1;
                Expr::Map(v)
            }
            other => return err(format!("unexpected {other:?} at {}", self.pos())),
        })
    }
}

/// A compiled expression.
#[derive(Debug, Clone)]
pub struct Program {
    expr: Expr,
}

impl Program {
    /// Parses `src`; `Err` says what and where.
    pub fn compile(src: &str) -> Result<Program, Error> {
        if src.len() > MAX_LEN {
            return err(format!("is {} bytes long; at most {MAX_LEN}", src.len()));
        }
        let toks = lex(src)?;
        let mut p = Parser { toks, at: 0, depth: 0 };
        let expr = p.expr()?;
        if p.at != p.toks.len() {
            return err(format!("unexpected text at {}", p.pos()));
        }
        Ok(Program { expr })
    }

    /// Evaluates with the variables `vars`, within [`MAX_STEPS`].
    pub fn eval(&self, vars: &[(&str, Value)]) -> Result<Value, Error> {
        let mut ev = Eval {
            steps: 0,
            scope: vars.iter().map(|(k, v)| ((*k).to_owned(), v.clone())).collect(),
        };
        ev.eval(&self.expr)
    }
}

struct Eval {
    steps: u64,
    scope: Vec<(String, Value)>,
}

fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "bool",
        Value::Int(_) => "int",
        Value::Uint(_) => "uint",
        Value::Double(_) => "double",
        Value::String(_) => "string",
        Value::List(_) => "list",
        Value::Map(_) | Value::Domains(_) => "map",
        Value::Quantity(_) => "Quantity",
        Value::Semver(_) => "Semver",
        Value::Optional(_) => "optional",
    }
}

fn key_of(v: &Value) -> Result<Key, Error> {
    Ok(match v {
        Value::Bool(b) => Key::Bool(*b),
        Value::Int(i) => Key::Int(*i),
        Value::Uint(u) => Key::Uint(*u),
        Value::String(s) => Key::String(s.clone()),
        other => return err(format!("a {} cannot be a map key", type_name(other))),
    })
}

impl Eval {
    fn step(&mut self, n: u64) -> Result<(), Error> {
        self.steps = self.steps.saturating_add(n);
        if self.steps > MAX_STEPS {
            return err(format!("evaluation took more than {MAX_STEPS} steps"));
        }
        Ok(())
    }

    fn lookup(&self, name: &str) -> Result<Value, Error> {
        self.scope
            .iter()
            .rev()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.clone())
            .ok_or_else(|| Error(format!("undeclared reference to {name:?}")))
    }

    fn bool(&mut self, e: &Expr) -> Result<bool, Error> {
        match self.eval(e)? {
            Value::Bool(b) => Ok(b),
            other => err(format!("expected bool, got {}", type_name(&other))),
        }
    }

    fn eval(&mut self, e: &Expr) -> Result<Value, Error> {
        self.step(1)?;
        match e {
            Expr::Lit(v) => Ok(v.clone()),
            Expr::Ident(n) => self.lookup(n),
            Expr::Select(obj, field, optional) => {
                let v = self.eval(obj)?;
                select(v, field, *optional)
            }
            Expr::Index(obj, idx, optional) => {
                let (v, i) = (self.eval(obj)?, self.eval(idx)?);
                index(v, &i, *optional)
            }
            Expr::List(items) => {
                let v = items.iter().map(|x| self.eval(x)).collect::<Result<Vec<_>, _>>()?;
                Ok(Value::List(Arc::new(v)))
            }
            Expr::Map(items) => {
                let mut m = BTreeMap::new();
                for (k, v) in items {
                    let k = key_of(&self.eval(k)?)?;
                    let v = self.eval(v)?;
                    if m.insert(k, v).is_some() {
                        return err("duplicate map key");
                    }
                }
                Ok(Value::Map(Arc::new(m)))
            }
            Expr::Unary(op, x) => match (*op, self.eval(x)?) {
                ("!", Value::Bool(b)) => Ok(Value::Bool(!b)),
                ("-", Value::Int(i)) => {
                    i.checked_neg().map(Value::Int).ok_or_else(|| Error("int overflow".into()))
                }
                ("-", Value::Double(d)) => Ok(Value::Double(-d)),
                (op, v) => err(format!("no such overload: {op}{}", type_name(&v))),
            },
            Expr::Binary("&&", l, r) => match self.bool(l) {
                Ok(false) => Ok(Value::Bool(false)),
                Ok(true) => Ok(Value::Bool(self.bool(r)?)),
                Err(e) => match self.bool(r) {
                    Ok(false) => Ok(Value::Bool(false)),
                    _ => Err(e),
                },
            },
            Expr::Binary("||", l, r) => match self.bool(l) {
                Ok(true) => Ok(Value::Bool(true)),
                Ok(false) => Ok(Value::Bool(self.bool(r)?)),
                Err(e) => match self.bool(r) {
                    Ok(true) => Ok(Value::Bool(true)),
                    _ => Err(e),
                },
            },
            Expr::Binary(op, l, r) => {
                let (a, b) = (self.eval(l)?, self.eval(r)?);
                self.binary(op, a, b)
            }
            Expr::Cond(c, a, b) => {
                if self.bool(c)? {
                    self.eval(a)
                } else {
                    self.eval(b)
                }
            }
            Expr::Call(target, name, args) => self.call(target.as_deref(), name, args),
        }
    }

    fn binary(&mut self, op: &str, a: Value, b: Value) -> Result<Value, Error> {
        use Value::{Double, Int, List, String as S, Uint};
        let bad = |a: &Value, b: &Value| {
            err(format!("no such overload: {} {op} {}", type_name(a), type_name(b)))
        };
        Ok(match op {
            "==" => Value::Bool(equal(&a, &b)),
            "!=" => Value::Bool(!equal(&a, &b)),
            "<" | "<=" | ">" | ">=" => {
                let Some(o) = order(&a, &b) else { return bad(&a, &b) };
                Value::Bool(match op {
                    "<" => o.is_lt(),
                    "<=" => o.is_le(),
                    ">" => o.is_gt(),
                    _ => o.is_ge(),
                })
            }
            "in" => match &b {
                List(v) => {
                    self.step(v.len() as u64)?;
                    Value::Bool(v.iter().any(|x| equal(x, &a)))
                }
                Value::Map(m) | Value::Domains(m) => {
                    Value::Bool(key_of(&a).is_ok_and(|k| m.contains_key(&k)))
                }
                _ => return bad(&a, &b),
            },
            "+" => match (a, b) {
                (Int(x), Int(y)) => {
                    Int(x.checked_add(y).ok_or_else(|| Error("int overflow".into()))?)
                }
                (Uint(x), Uint(y)) => {
                    Uint(x.checked_add(y).ok_or_else(|| Error("uint overflow".into()))?)
                }
                (Double(x), Double(y)) => Double(x + y),
                (S(x), S(y)) => {
                    self.step((x.len() + y.len()) as u64)?;
                    S(format!("{x}{y}").into())
                }
                (List(x), List(y)) => {
                    self.step((x.len() + y.len()) as u64)?;
                    List(Arc::new(x.iter().chain(y.iter()).cloned().collect()))
                }
                (a, b) => return bad(&a, &b),
            },
            "-" | "*" | "/" | "%" => match (a, b) {
                (Int(x), Int(y)) => Int(match op {
                    "-" => x.checked_sub(y),
                    "*" => x.checked_mul(y),
                    "/" => x.checked_div(y),
                    _ => x.checked_rem(y),
                }
                .ok_or_else(|| Error(format!("int overflow or division by zero in {op}")))?),
                (Uint(x), Uint(y)) => Uint(
                    match op {
                        "-" => x.checked_sub(y),
                        "*" => x.checked_mul(y),
                        "/" => x.checked_div(y),
                        _ => x.checked_rem(y),
                    }
                    .ok_or_else(|| Error(format!("uint overflow or division by zero in {op}")))?,
                ),
                (Double(x), Double(y)) if op != "%" => Double(match op {
                    "-" => x - y,
                    "*" => x * y,
                    _ => x / y,
                }),
                (a, b) => return bad(&a, &b),
            },
            _ => return bad(&a, &b),
        })
    }

    fn call(&mut self, target: Option<&Expr>, name: &str, args: &[Expr]) -> Result<Value, Error> {
        // Macros first: their arguments are not evaluated up front.
        match (target, name, args) {
            (None, "has", [Expr::Select(obj, field, false)]) => {
                let v = self.eval(obj)?;
                return match v {
                    Value::Map(m) | Value::Domains(m) => {
                        Ok(Value::Bool(m.contains_key(&Key::String(field.as_str().into()))))
                    }
                    other => err(format!("has() on a {}", type_name(&other))),
                };
            }
            (Some(Expr::Ident(cel)), "bind", [Expr::Ident(var), init, body]) if cel == "cel" => {
                let v = self.eval(init)?;
                self.scope.push((var.clone(), v));
                let out = self.eval(body);
                self.scope.pop();
                return out;
            }
            (
                Some(t),
                "all" | "exists" | "exists_one" | "map" | "filter",
                [Expr::Ident(var), body],
            ) => {
                let items: Vec<Value> = match self.eval(t)? {
                    Value::List(v) => v.as_ref().clone(),
                    Value::Map(m) | Value::Domains(m) => m
                        .keys()
                        .map(|k| match k {
                            Key::Bool(b) => Value::Bool(*b),
                            Key::Int(i) => Value::Int(*i),
                            Key::Uint(u) => Value::Uint(*u),
                            Key::String(s) => Value::String(s.clone()),
                        })
                        .collect(),
                    other => return err(format!("{name}() on a {}", type_name(&other))),
                };
                return self.comprehension(name, var, &items, body);
            }
            _ => {}
        }
        let this = target.map(|t| self.eval(t)).transpose()?;
        let args = args.iter().map(|a| self.eval(a)).collect::<Result<Vec<_>, _>>()?;
        call(this, name, &args, self)
    }

    fn comprehension(
        &mut self,
        name: &str,
        var: &str,
        items: &[Value],
        body: &Expr,
    ) -> Result<Value, Error> {
        let mut kept = Vec::new();
        let mut count = 0usize;
        let mut first_err = None;
        for item in items {
            self.step(1)?;
            self.scope.push((var.to_owned(), item.clone()));
            let r = self.eval(body);
            self.scope.pop();
            match name {
                "map" => kept.push(r?),
                _ => {
                    let b = match r {
                        Ok(Value::Bool(b)) => b,
                        Ok(other) => {
                            return err(format!("{name}() body gave a {}", type_name(&other)));
                        }
                        Err(e) if matches!(name, "all" | "exists") => {
                            first_err.get_or_insert(e);
                            continue;
                        }
                        Err(e) => return Err(e),
                    };
                    match name {
                        "all" if !b => return Ok(Value::Bool(false)),
                        "exists" if b => return Ok(Value::Bool(true)),
                        "filter" if b => kept.push(item.clone()),
                        "exists_one" if b => count += 1,
                        _ => {}
                    }
                }
            }
        }
        if let Some(e) = first_err {
            return Err(e);
        }
        Ok(match name {
            "all" => Value::Bool(true),
            "exists" => Value::Bool(false),
            "exists_one" => Value::Bool(count == 1),
            _ => Value::List(Arc::new(kept)),
        })
    }
}

fn select(v: Value, field: &str, optional: bool) -> Result<Value, Error> {
    let (v, optional) = match v {
        Value::Optional(None) => return Ok(Value::Optional(None)),
        Value::Optional(Some(inner)) => (*inner, true),
        v => (v, optional),
    };
    match v {
        Value::Map(m) | Value::Domains(m) => match m.get(&Key::String(field.into())) {
            Some(x) if optional => Ok(Value::Optional(Some(Box::new(x.clone())))),
            Some(x) => Ok(x.clone()),
            None if optional => Ok(Value::Optional(None)),
            None => err(format!("no such key: {field}")),
        },
        other => err(format!("no such field {field:?} on a {}", type_name(&other))),
    }
}

fn index(v: Value, i: &Value, optional: bool) -> Result<Value, Error> {
    let (v, optional) = match v {
        Value::Optional(None) => return Ok(Value::Optional(None)),
        Value::Optional(Some(inner)) => (*inner, true),
        v => (v, optional),
    };
    let found = match (&v, i) {
        (Value::Map(m), k) => m.get(&key_of(k)?).cloned(),
        (Value::Domains(m), k) => {
            Some(m.get(&key_of(k)?).cloned().unwrap_or_else(|| Value::Map(Arc::default())))
        }
        (Value::List(l), Value::Int(n)) => usize::try_from(*n).ok().and_then(|n| l.get(n)).cloned(),
        (Value::List(l), Value::Uint(n)) => {
            usize::try_from(*n).ok().and_then(|n| l.get(n)).cloned()
        }
        (a, b) => return err(format!("no such overload: {}[{}]", type_name(a), type_name(b))),
    };
    match (found, optional) {
        (Some(x), true) => Ok(Value::Optional(Some(Box::new(x)))),
        (Some(x), false) => Ok(x),
        (None, true) => Ok(Value::Optional(None)),
        (None, false) => err(match i {
            Value::String(s) => format!("no such key: {s}"),
            _ => "index out of range".to_owned(),
        }),
    }
}

fn equal(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Int(x), Value::Uint(y)) | (Value::Uint(y), Value::Int(x)) => {
            u64::try_from(*x).is_ok_and(|x| x == *y)
        }
        (Value::Int(x), Value::Double(y)) | (Value::Double(y), Value::Int(x)) => (*x as f64) == *y,
        (Value::Uint(x), Value::Double(y)) | (Value::Double(y), Value::Uint(x)) => {
            (*x as f64) == *y
        }
        (Value::List(x), Value::List(y)) => {
            x.len() == y.len() && x.iter().zip(y.iter()).all(|(a, b)| equal(a, b))
        }
        _ => a == b,
    }
}

fn order(a: &Value, b: &Value) -> Option<std::cmp::Ordering> {
    match (a, b) {
        (Value::Int(x), Value::Int(y)) => Some(x.cmp(y)),
        (Value::Uint(x), Value::Uint(y)) => Some(x.cmp(y)),
        (Value::Int(x), Value::Uint(y)) => Some(i128::from(*x).cmp(&i128::from(*y))),
        (Value::Uint(x), Value::Int(y)) => Some(i128::from(*x).cmp(&i128::from(*y))),
        (Value::Double(x), Value::Double(y)) => x.partial_cmp(y),
        (Value::Int(x), Value::Double(y)) => (*x as f64).partial_cmp(y),
        (Value::Double(x), Value::Int(y)) => x.partial_cmp(&(*y as f64)),
        (Value::String(x), Value::String(y)) => Some(x.cmp(y)),
        (Value::Bool(x), Value::Bool(y)) => Some(x.cmp(y)),
        _ => None,
    }
}

fn call(this: Option<Value>, name: &str, args: &[Value], ev: &mut Eval) -> Result<Value, Error> {
    use Value::{Bool, Double, Int, Quantity as Q, String as S, Uint};
    let bad = || {
        let on = this.as_ref().map(|t| format!("{}.", type_name(t))).unwrap_or_default();
        let a: Vec<&str> = args.iter().map(type_name).collect();
        err(format!("no such overload: {on}{name}({})", a.join(", ")))
    };
    Ok(match (this.as_ref(), name, args) {
        (None, "size", [x]) | (Some(x), "size", []) => Int(match x {
            S(s) => s.chars().count() as i64,
            Value::List(l) => l.len() as i64,
            Value::Map(m) | Value::Domains(m) => m.len() as i64,
            _ => return bad(),
        }),
        (Some(S(s)), "contains" | "startsWith" | "endsWith", [S(t)]) => {
            ev.step((s.len() + t.len()) as u64)?;
            Bool(match name {
                "contains" => s.contains(t.as_ref()),
                "startsWith" => s.starts_with(t.as_ref()),
                _ => s.ends_with(t.as_ref()),
            })
        }
        (Some(S(s)), "matches", [S(re)]) | (None, "matches", [S(s), S(re)]) => {
            ev.step((s.len() * re.len().max(1)) as u64)?;
            // regex-lite matches in time linear in the text; the compiled program is capped.
            let re = regex_lite::RegexBuilder::new(re)
                .size_limit(1 << 20)
                .nest_limit(64)
                .build()
                .map_err(|e| Error(format!("bad regex: {e}")))?;
            Bool(re.is_match(s))
        }
        (Some(S(s)), "lowerAscii", []) => S(s.to_ascii_lowercase().into()),
        (Some(S(s)), "upperAscii", []) => S(s.to_ascii_uppercase().into()),
        (None, "int", [x]) => Int(match x {
            Int(i) => *i,
            Uint(u) => i64::try_from(*u).map_err(|_| Error("int overflow".into()))?,
            Double(d) if d.is_finite() && d.abs() < 9.2e18 => *d as i64,
            S(s) => s.parse().map_err(|_| Error(format!("cannot convert {s:?} to int")))?,
            _ => return bad(),
        }),
        (None, "uint", [x]) => Uint(match x {
            Int(i) => u64::try_from(*i).map_err(|_| Error("uint overflow".into()))?,
            Uint(u) => *u,
            S(s) => s.parse().map_err(|_| Error(format!("cannot convert {s:?} to uint")))?,
            _ => return bad(),
        }),
        (None, "double", [x]) => Double(match x {
            Int(i) => *i as f64,
            Uint(u) => *u as f64,
            Double(d) => *d,
            S(s) => s.parse().map_err(|_| Error(format!("cannot convert {s:?} to double")))?,
            _ => return bad(),
        }),
        (None, "string", [x]) => S(match x {
            S(s) => s.to_string(),
            Int(i) => i.to_string(),
            Uint(u) => u.to_string(),
            Double(d) => d.to_string(),
            Bool(b) => b.to_string(),
            _ => return bad(),
        }
        .into()),
        // DRAListTypeAttributes: `includes` works on a scalar and on a list.
        (Some(Value::List(l)), "includes", [x]) => {
            ev.step(l.len() as u64)?;
            Bool(l.iter().any(|v| equal(v, x)))
        }
        (Some(v), "includes", [x]) => Bool(equal(v, x)),
        (Some(Value::Optional(o)), "orValue", [d]) => {
            o.as_deref().cloned().unwrap_or_else(|| d.clone())
        }
        (Some(Value::Optional(o)), "hasValue", []) => Bool(o.is_some()),
        (Some(Value::Optional(o)), "value", []) => match o {
            Some(v) => (**v).clone(),
            None => return err("optional.none() has no value"),
        },
        (None, "quantity", [S(s)]) => {
            Q(parse_quantity(s).ok_or_else(|| Error(format!("invalid quantity {s:?}")))?)
        }
        (None, "isQuantity", [S(s)]) => Bool(parse_quantity(s).is_some()),
        (None, "semver", [S(s)]) => Value::Semver(Arc::new(
            Semver::parse(s).ok_or_else(|| Error(format!("invalid semver {s:?}")))?,
        )),
        (None, "isSemver", [S(s)]) => Bool(Semver::parse(s).is_some()),
        (Some(Q(a)), "compareTo", [Q(b)]) => Int(a.cmp(b) as i64),
        (Some(Q(a)), "isGreaterThan", [Q(b)]) => Bool(a > b),
        (Some(Q(a)), "isLessThan", [Q(b)]) => Bool(a < b),
        (Some(Q(a)), "add" | "sub", [y]) => {
            let b = match y {
                Q(b) => *b,
                Int(i) => i128::from(*i) * 1_000_000_000,
                _ => return bad(),
            };
            Q(if name == "add" { a.checked_add(b) } else { a.checked_sub(b) }
                .ok_or_else(|| Error("quantity overflow".into()))?)
        }
        (Some(Q(a)), "isInteger", []) => {
            Bool(a % 1_000_000_000 == 0 && i64::try_from(a / 1_000_000_000).is_ok())
        }
        (Some(Q(a)), "asInteger", []) => {
            if a % 1_000_000_000 != 0 {
                return err("quantity is not an integer");
            }
            Int(i64::try_from(a / 1_000_000_000)
                .map_err(|_| Error("quantity overflows int".into()))?)
        }
        (Some(Q(a)), "asApproximateFloat", []) => Double(*a as f64 / 1e9),
        (Some(Q(a)), "sign", []) => Int(a.signum() as i64),
        (Some(Value::Semver(a)), "compareTo", [Value::Semver(b)]) => Int(a.cmp(b) as i64),
        (Some(Value::Semver(a)), "isGreaterThan", [Value::Semver(b)]) => Bool(a.cmp(b).is_gt()),
        (Some(Value::Semver(a)), "isLessThan", [Value::Semver(b)]) => Bool(a.cmp(b).is_lt()),
        (Some(Value::Semver(a)), "major", []) => Int(i64::try_from(a.major).unwrap_or(i64::MAX)),
        (Some(Value::Semver(a)), "minor", []) => Int(i64::try_from(a.minor).unwrap_or(i64::MAX)),
        (Some(Value::Semver(a)), "patch", []) => Int(i64::try_from(a.patch).unwrap_or(i64::MAX)),
        _ => return bad(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn device() -> Value {
        let attrs: BTreeMap<Key, Value> = BTreeMap::from([(
            Key::String("gpu.example.com".into()),
            Value::Map(Arc::new(BTreeMap::from([
                (Key::String("model".into()), Value::String("A100".into())),
                (Key::String("cores".into()), Value::Int(108)),
                (
                    Key::String("driverVersion".into()),
                    Value::Semver(Arc::new(Semver::parse("535.104.5").unwrap())),
                ),
            ]))),
        )]);
        let cap = BTreeMap::from([(
            Key::String("gpu.example.com".into()),
            Value::Map(Arc::new(BTreeMap::from([(
                Key::String("memory".into()),
                Value::Quantity(parse_quantity("80Gi").unwrap()),
            )]))),
        )]);
        Value::Map(Arc::new(BTreeMap::from([
            (Key::String("driver".into()), Value::String("gpu.example.com".into())),
            (Key::String("attributes".into()), Value::Domains(Arc::new(attrs))),
            (Key::String("capacity".into()), Value::Domains(Arc::new(cap))),
        ])))
    }

    fn run(src: &str) -> Result<Value, Error> {
        Program::compile(src)?.eval(&[("device", device())])
    }

    #[test]
    fn the_dra_environment_evaluates() {
        for (src, want) in [
            (r#"device.driver == "gpu.example.com""#, true),
            (
                r#"device.attributes["gpu.example.com"].model == 'A100' && device.attributes["gpu.example.com"].cores >= 100"#,
                true,
            ),
            (r#"device.capacity["gpu.example.com"].memory.compareTo(quantity("40Gi")) > 0"#, true),
            (r#"device.capacity["gpu.example.com"].memory.isGreaterThan(quantity("81Gi"))"#, false),
            (
                r#"device.attributes["gpu.example.com"].driverVersion.isGreaterThan(semver("535.0.0"))"#,
                true,
            ),
            (r#"semver("1.0.0-alpha").isLessThan(semver("1.0.0"))"#, true),
            (
                r#"cel.bind(g, device.attributes["gpu.example.com"], g.model.startsWith("A") && g.cores % 2 == 0)"#,
                true,
            ),
            (r#"has(device.attributes["gpu.example.com"].nvlink)"#, false),
            (r#"device.attributes["gpu.example.com"].?nvlink.orValue(false) == false"#, true),
            (r#"device.attributes["other.example.com"].?x.hasValue()"#, false),
            (
                r#""A100" in ["H100", "A100"] && [1, 2, 3].all(x, x > 0) && [1, 2].exists_one(x, x == 2)"#,
                true,
            ),
            (r#"[1, 2, 3].filter(x, x > 1).size() == 2 && [1, 2].map(x, x * 2)[1] == 4"#, true),
            (r#"device.attributes["gpu.example.com"].model.includes("A100")"#, true),
            (r#"device.attributes["gpu.example.com"].model.matches("^A[0-9]+$")"#, true),
            (
                r#"quantity("1.5Gi").compareTo(quantity("1536Mi")) == 0 && quantity("500m").isLessThan(quantity("1"))"#,
                true,
            ),
            (r#"1u == 1 && 2.0 > 1 && -3 < 0 && (true ? 1 : 2) == 1"#, true),
            // `false && error` is false, whichever side the error is on.
            (r#"device.attributes["x"].y == 1 && false"#, false),
            (r#"true || device.nope"#, true),
        ] {
            assert_eq!(run(src), Ok(Value::Bool(want)), "{src}");
        }
    }

    #[test]
    fn errors_name_what_went_wrong() {
        for (src, says) in [
            (r#"device.attributes["gpu.example.com"].nvlink"#, "no such key: nvlink"),
            (r#"device.nope == 1"#, "no such key: nope"),
            (r#"1 + "a""#, "no such overload: int + string"),
            (r#"quantity("banana")"#, "invalid quantity"),
            (r#"9223372036854775807 + 1 > 0"#, "int overflow"),
            (r#"x == 1"#, "undeclared reference"),
        ] {
            let e = run(src).unwrap_err();
            assert!(e.0.contains(says), "{src}: {e}");
        }
        for (src, says) in [
            ("1 +", "unexpected end"),
            ("(1", "expected \")\""),
            ("\"open", "unterminated string"),
            ("1 # 2", "unexpected character"),
        ] {
            let e = Program::compile(src).unwrap_err();
            assert!(e.0.contains(says), "{src}: {e}");
        }
    }

    /// Hostile expressions: too long, too deep, too slow. Each is refused or stopped quickly.
    #[test]
    fn hostile_expressions_are_bounded() {
        let long = format!("{}true", "true && ".repeat(2000));
        assert!(Program::compile(&long).unwrap_err().0.contains("bytes long"));
        // A long disjunction is fine (and shallow); a long sum is as deep as it is long.
        let wide = format!("{}false", "device.driver == 'x' || ".repeat(300));
        assert_eq!(run(&wide), Ok(Value::Bool(false)));
        let sum = format!("{}1 > 0", "1 + ".repeat(500));
        assert!(Program::compile(&sum).unwrap_err().0.contains("nests deeper"));
        let chain = format!("device{}", ".a".repeat(500));
        assert!(Program::compile(&chain).unwrap_err().0.contains("nests deeper"));
        let deep = format!("{}1{}", "(".repeat(5000), ")".repeat(5000));
        assert!(Program::compile(&deep[..deep.len().min(MAX_LEN)]).is_err());
        let deep = format!("{}1{}", "[".repeat(200), "]".repeat(200));
        assert!(Program::compile(&deep).unwrap_err().0.contains("nests deeper"));
        let nots = format!("{}true", "!".repeat(3000));
        assert!(Program::compile(&nots).unwrap_err().0.contains("nests deeper"));
        // Nested comprehensions over lists: 300^3 rounds would take minutes in a debug build;
        // stopped at the step budget instead.
        let list = format!("[{}]", (0..300).map(|i| i.to_string()).collect::<Vec<_>>().join(","));
        let slow = format!("{list}.all(a, {list}.all(b, {list}.all(c, a + b + c >= 0)))");
        let t = std::time::Instant::now();
        let e = run(&slow).unwrap_err();
        assert!(e.0.contains("more than 1000000 steps"), "{e}");
        assert!(t.elapsed() < std::time::Duration::from_secs(5), "{:?}", t.elapsed());
    }

    #[test]
    fn quantities_are_exact() {
        assert_eq!(parse_quantity("1Ki"), Some(1024 * 1_000_000_000));
        assert_eq!(parse_quantity("1.5"), Some(1_500_000_000));
        assert_eq!(parse_quantity("500m"), Some(500_000_000));
        assert_eq!(parse_quantity("1e3"), Some(1_000_000_000_000));
        assert_eq!(parse_quantity("1n"), Some(1));
        assert_eq!(parse_quantity("-2"), Some(-2_000_000_000));
        assert_eq!(parse_quantity("1Zi"), None);
        assert_eq!(parse_quantity(""), None);
    }
}
