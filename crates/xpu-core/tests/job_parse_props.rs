//! Property tests for manifest parsing: no input makes the parser panic, whether random text,
//! random JSON trees, or the seeds' Job manifests with bytes mutated, deleted or spliced.

#![allow(clippy::unwrap_used)]

use proptest::prelude::*;
use serde_json::Value;
use xpu_core::job;

const SEED_SINGLE: &str = "apiVersion: batch/v1\nkind: Job\nmetadata:\n  name: job-1\nspec:\n  template:\n    spec:\n      nodeSelector:\n        cloud.google.com/gke-flex-start: \"true\"\n        cloud.google.com/gke-tpu-accelerator: ACCELERATOR_TYPE\n        cloud.google.com/gke-tpu-topology: TPU_TOPOLOGY\n      containers:\n      - name: container-1\n        image: gcr.io/k8s-staging-perf-tests/sleep:latest\n        args: [\"3600s\"] # Sleep for 1 hour\n        resources:\n          requests:\n              google.com/tpu: 4\n          limits:\n              google.com/tpu: 4\n      restartPolicy: OnFailure\n";

const SEED_MULTI: &str = "apiVersion: v1\nkind: Service\nmetadata:\n  name: headless-svc\nspec:\n  clusterIP: None\n  selector:\n    job-name: job-1\n---\napiVersion: batch/v1\nkind: Job\nmetadata:\n  name: job-1\nspec:\n  backoffLimit: 0\n  completions: 2\n  parallelism: 2\n  completionMode: Indexed\n  template:\n    spec:\n      subdomain: headless-svc\n      restartPolicy: Never\n      containers:\n      - name: tpu-job\n        image: us-docker.pkg.dev/cloud-tpu-images/jax-ai-image/tpu:latest\n        command:\n        - bash\n        - -c\n        - |\n          python -c 'import jax; print(\"TPU cores:\", jax.device_count())'\n        resources:\n          requests:\n            google.com/tpu: 4\n          limits:\n            google.com/tpu: 4\n";

/// Arbitrary JSON trees whose keys are drawn from the names the parser looks for, so the
/// search reaches deep into the Job structure instead of failing at the top.
fn json_tree() -> impl Strategy<Value = Value> {
    let keys = prop::sample::select(vec![
        "apiVersion",
        "kind",
        "metadata",
        "name",
        "spec",
        "template",
        "containers",
        "command",
        "args",
        "resources",
        "limits",
        "requests",
        "nvidia.com/gpu",
        "google.com/tpu",
        "cpu",
        "memory",
        "restartPolicy",
        "completions",
        "parallelism",
        "completionMode",
        "env",
        "value",
        "nodeSelector",
        "gpus",
        "annotations",
        "xpu.dev/priority",
        "backoffLimit",
    ]);
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<f64>()
            .prop_map(|f| serde_json::Number::from_f64(f).map_or(Value::Null, Value::Number)),
        prop::sample::select(vec![
            "batch/v1",
            "v1",
            "Job",
            "Pod",
            "Never",
            "OnFailure",
            "Indexed",
            "1",
            "500m",
            "1Gi",
            "-3",
            ""
        ])
        .prop_map(Value::from),
        ".{0,12}".prop_map(Value::from),
    ];
    leaf.prop_recursive(6, 64, 6, move |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            prop::collection::vec((keys.clone(), inner), 0..6).prop_map(|kv| {
                Value::Object(kv.into_iter().map(|(k, v)| (k.to_owned(), v)).collect())
            }),
        ]
    })
}

fn mutate(seed: &str, edits: &[(usize, u8, u8)]) -> String {
    let mut bytes = seed.as_bytes().to_vec();
    for &(pos, op, b) in edits {
        if bytes.is_empty() {
            break;
        }
        let i = pos % bytes.len();
        match op % 4 {
            0 => bytes[i] = b,
            1 => {
                bytes.remove(i);
            }
            2 => bytes.insert(i, b),
            _ => {
                let j = (i + usize::from(b)).min(bytes.len());
                let chunk = bytes[i..j].to_vec();
                bytes.splice(i..i, chunk);
            }
        }
    }
    String::from_utf8_lossy(&bytes).into_owned()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn random_text_never_panics(text in ".{0,300}") {
        let _ = job::parse(&text);
    }

    #[test]
    fn random_json_trees_never_panic(v in json_tree()) {
        let _ = job::parse(&v.to_string());
        if let Ok(yaml) = serde_norway::to_string(&v) {
            let _ = job::parse(&yaml);
        }
    }

    #[test]
    fn mutated_seed_manifests_never_panic(
        edits in prop::collection::vec((any::<usize>(), any::<u8>(), any::<u8>()), 1..8),
        multi in any::<bool>(),
    ) {
        let seed = if multi { SEED_MULTI } else { SEED_SINGLE };
        let text = mutate(seed, &edits);
        if let Ok(p) = job::parse(&text) {
            // Whatever is accepted is a usable job.
            prop_assert!(!p.spec.container.argv.is_empty());
            prop_assert!(p.spec.completions >= 1);
        }
    }
}

#[test]
fn yaml_alias_bomb_is_rejected_quickly() {
    let mut text = String::from("a: &a [x, x, x, x, x, x, x, x, x]\n");
    for i in 0..12 {
        let prev = if i == 0 { "a".to_owned() } else { format!("l{}", i - 1) };
        text.push_str(&format!("l{i}: &l{i} [*{prev}, *{prev}, *{prev}, *{prev}, *{prev}, *{prev}, *{prev}, *{prev}, *{prev}]\n"));
    }
    assert!(job::parse(&text).is_err());
}
