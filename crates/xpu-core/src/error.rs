//! Error chains as one line.

/// `outer: inner: root cause` on one line, as the CLI prints errors and logs record them,
/// leaving out a link whose text the line already holds: some errors (the OS's wrapped in a
/// store's, kube's) put their source in their own text and also return it from `source()`.
pub fn chain_once(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut next = e.source();
    while let Some(link) = next {
        let t = link.to_string();
        if !text.contains(&t) {
            text.push_str(": ");
            text.push_str(&t);
        }
        next = link.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("reading x: {0}")]
    struct Embeds(#[source] std::io::Error);

    #[derive(Debug, thiserror::Error)]
    #[error("starting")]
    struct Outer(#[source] Embeds);

    #[test]
    fn a_link_already_said_is_left_out() {
        let e = Outer(Embeds(std::io::Error::other("disk gone")));
        assert_eq!(chain_once(&e), "starting: reading x: disk gone");
    }
}
