//! The simulator: the OpenB placement benchmark ([`openb`]) and, later, trace replay over time.

pub mod openb;
