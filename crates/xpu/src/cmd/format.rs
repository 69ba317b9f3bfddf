//! The one `--format` every command prints in. A command takes the formats it can print
//! ([`Format::only`]), so `--format csv` on a command without CSV is a usage error that lists
//! the command's own formats, and its help shows only those.

use clap::ValueEnum;
use clap::builder::{PossibleValuesParser, TypedValueParser};

/// What a command prints.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Format {
    /// Aligned columns for a terminal.
    Table,
    /// The files or lines the command produces, as written (configuration snippets, a feature
    /// file).
    Text,
    /// The stable, documented JSON shape.
    Json,
    Yaml,
    Csv,
    /// Node Feature Discovery labels (`key=value` lines).
    Labels,
}

impl Format {
    /// The value parser of a `--format` that takes only `allowed`.
    pub fn only(allowed: &'static [Format]) -> impl TypedValueParser<Value = Format> {
        PossibleValuesParser::new(allowed.iter().filter_map(ValueEnum::to_possible_value))
            .try_map(|name| Format::from_str(&name, false))
    }
}

impl std::fmt::Display for Format {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.to_possible_value() {
            Some(v) => f.write_str(v.get_name()),
            None => Ok(()),
        }
    }
}

/// `--format table` or `json`, the pair most commands print.
pub const TABLE_JSON: &[Format] = &[Format::Table, Format::Json];

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Debug, Parser)]
    struct Cmd {
        #[arg(long, value_parser = Format::only(TABLE_JSON), default_value_t = Format::Table)]
        format: Format,
    }

    #[test]
    fn a_command_takes_only_its_formats() {
        let parse = |args: &[&str]| Cmd::try_parse_from(args).map(|c| c.format);
        assert_eq!(parse(&["x"]).ok(), Some(Format::Table));
        assert_eq!(parse(&["x", "--format", "json"]).ok(), Some(Format::Json));
        let e = parse(&["x", "--format", "csv"]).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(
            e.contains("invalid value 'csv'") && e.contains("[possible values: table, json]"),
            "{e}"
        );
    }
}
