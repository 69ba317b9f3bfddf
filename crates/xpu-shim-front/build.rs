//! Declares the `xpu_bare` cfg. `scripts/build-shim` builds the binary with `--cfg xpu_bare` in
//! the `shim` profile (`panic = "abort"`): then it brings its own entry point, relocation and
//! memory functions (`src/bare.rs`) and is linked, by the flags that script passes, as a
//! static-pie executable without the C start files and without any C library, so that a symbol
//! only libc could provide fails the link instead of pulling glibc's start-up (and its `cpuid`
//! probing) back in. Without the cfg it is an ordinary std program running the same code.

fn main() {
    println!("cargo::rerun-if-changed=build.rs");
    println!("cargo::rustc-check-cfg=cfg(xpu_bare)");
}
