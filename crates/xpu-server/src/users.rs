//! The host's user accounts, from `/etc/passwd`: whom a token names (`<data-dir>/tokens`) and
//! the name and home a job's owner runs with ([`crate::executor::RunAs`]).

use std::path::{Path, PathBuf};

/// One line of `/etc/passwd`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Account {
    pub name: String,
    pub uid: u32,
    pub gid: u32,
    pub home: PathBuf,
}

/// The largest `/etc/passwd` read (a host with tens of thousands of accounts is a few MiB).
const MAX_PASSWD: u64 = 4 << 20;

/// The first account `pick` takes, reading `/etc/passwd` as every file the daemon did not write
/// is read ([`crate::container::read_bounded`]); `None` when there is none or it cannot be read.
fn find(pick: impl Fn(&Account) -> bool) -> Option<Account> {
    let text = crate::container::read_bounded(Path::new("/etc/passwd"), MAX_PASSWD).ok()?;
    String::from_utf8_lossy(&text).lines().find_map(|line| {
        let f: Vec<&str> = line.split(':').collect();
        let [name, _, uid, gid, _, home, ..] = f.as_slice() else { return None };
        let a = Account {
            name: (*name).to_owned(),
            uid: uid.parse().ok()?,
            gid: gid.parse().ok()?,
            home: PathBuf::from(home),
        };
        pick(&a).then_some(a)
    })
}

/// The account of `uid`.
pub fn by_uid(uid: u32) -> Option<Account> {
    find(|a| a.uid == uid)
}

/// The account named `name`.
pub fn by_name(name: &str) -> Option<Account> {
    find(|a| a.name == name)
}
