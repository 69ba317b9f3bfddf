//! The simulator: the OpenB placement benchmark ([`openb`]), trace replay over time
//! ([`replay`]) on a cluster described by the `--cluster` grammar ([`spec`]), and an SVG plot of
//! allocation curves ([`plot`]). Pure: traces come in already parsed ([`crate::trace`]).

pub mod dra;
pub mod openb;
pub mod plot;
pub mod replay;
pub mod spec;
pub mod variant;
