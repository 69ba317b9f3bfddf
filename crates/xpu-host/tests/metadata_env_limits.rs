//! `metadata_env::run` on metadata whose YAML aliases would blow the environment file up: it is
//! refused with the limit named, and nothing is written.

#![allow(clippy::unwrap_used)]

use xpu_host::metadata_env;

#[test]
fn alias_amplified_metadata_is_refused_and_nothing_written() {
    // One 10 KB value named by 1,000 aliases: 20 KB of metadata, a 10 MB environment file.
    let mut y = format!("BASE: &v {}\n", "x".repeat(10_000));
    for i in 0..1_000 {
        y.push_str(&format!("K{i}: *v\n"));
    }
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("tpu-env.yaml");
    let output = dir.path().join("tpu-env.sh");
    std::fs::write(&input, &y).unwrap();
    let e = metadata_env::run(&input, &output).unwrap_err().to_string();
    assert!(e.contains("tpu-env.yaml"), "{e}");
    assert!(e.contains("expands to more than"), "{e}");
    assert!(e.contains("remove the aliases"), "{e}");
    assert!(!output.exists());

    // A few aliases stay within the limit and convert as before.
    std::fs::write(&input, "ZONE: &z us-east5-a\nWORKER_ZONE: *z\n").unwrap();
    assert_eq!(metadata_env::run(&input, &output).unwrap(), 2);
    assert_eq!(
        std::fs::read_to_string(&output).unwrap(),
        "ZONE=\"us-east5-a\"\nWORKER_ZONE=\"us-east5-a\"\n"
    );
}
