//! A stand-in for NVIDIA's `nvidia-cuda-mps-control`: `-d` marks the daemon of the pipe
//! directory in `CUDA_MPS_PIPE_DIRECTORY` up (a file `control` in it naming the GPU of
//! `CUDA_VISIBLE_DEVICES`, where the real daemon has its control socket), `get_server_list` on
//! standard input succeeds only while it is up, `quit` marks it down. Each start and quit is
//! logged to `<dir>/calls` as `start <CUDA_VISIBLE_DEVICES>` / `quit <…>`.

use std::path::{Path, PathBuf};

/// Writes the fake control binary into `dir` and returns its path.
pub fn fake_control(dir: &Path) -> PathBuf {
    let control = dir.join("mps-control.sh");
    std::fs::write(
        &control,
        format!(
            r#"#!/bin/sh
up="$CUDA_MPS_PIPE_DIRECTORY/control"
if [ "$1" = -d ]; then echo "start $CUDA_VISIBLE_DEVICES" >> {log}; echo "$CUDA_VISIBLE_DEVICES" > "$up"; exit 0; fi
read cmd
case "$cmd" in
  get_server_list) [ -e "$up" ] ;;
  quit) echo "quit $CUDA_VISIBLE_DEVICES" >> {log}; rm -f "$up" ;;
  *) exit 2 ;;
esac
"#,
            log = dir.join("calls").display()
        ),
    )
    .expect("writing the fake MPS control");
    std::fs::set_permissions(&control, std::os::unix::fs::PermissionsExt::from_mode(0o755))
        .expect("making the fake MPS control executable");
    control
}

/// The fake's log of starts and quits.
pub fn calls(dir: &Path) -> String {
    std::fs::read_to_string(dir.join("calls")).unwrap_or_default()
}
