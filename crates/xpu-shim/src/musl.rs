//! The two glibc functions that Rust's standard library for `x86_64-unknown-linux-gnu` names and
//! musl does not have, for the build `scripts/build-shim` makes: that std, linked statically
//! with musl instead of glibc (`--cfg xpu_musl`). glibc's start-up probes the CPU's caches with
//! about a hundred `cpuid` instructions, each a trap to the hypervisor in a virtual machine,
//! 0.6 ms per process on the KVM guests xpu is built on; musl's start-up does not. There is no
//! prebuilt std for the musl target here, and the gnu target's std keeps to what musl also
//! provides, apart from these two.

use std::ffi::{c_char, c_int, c_void};

/// std reads the glibc version to decide whether `posix_spawn` reports a missing program itself
/// (2.24 and later); below that it forks and execs, which is what it does here. 2.23 is the
/// newest version that keeps std on that path.
#[unsafe(no_mangle)]
extern "C" fn gnu_get_libc_version() -> *const c_char {
    c"2.23".as_ptr()
}

/// glibc's `struct dl_find_object` on x86-64 (no `dlfo_eh_dbase`, no `dlfo_eh_count`).
#[repr(C)]
pub struct DlFindObject {
    flags: u64,
    map_start: *mut c_void,
    map_end: *mut c_void,
    link_map: *mut c_void,
    eh_frame: *mut c_void,
    reserved: [u64; 7],
}

/// The leading fields of `struct dl_phdr_info`, all this reads.
#[repr(C)]
struct DlPhdrInfo {
    addr: usize,
    name: *const c_char,
    phdr: *const Elf64Phdr,
    phnum: u16,
}

#[repr(C)]
struct Elf64Phdr {
    p_type: u32,
    p_flags: u32,
    p_offset: u64,
    p_vaddr: u64,
    p_paddr: u64,
    p_filesz: u64,
    p_memsz: u64,
    p_align: u64,
}

const PT_LOAD: u32 = 1;
const PT_GNU_EH_FRAME: u32 = 0x6474_e550;

unsafe extern "C" {
    fn dl_iterate_phdr(
        callback: unsafe extern "C" fn(*mut DlPhdrInfo, usize, *mut c_void) -> c_int,
        data: *mut c_void,
    ) -> c_int;
}

/// What `_dl_find_object` looks for and what it found: the loaded range holding `pc`, and that
/// object's `.eh_frame_hdr`.
struct Search {
    pc: usize,
    start: usize,
    end: usize,
    eh_frame: usize,
}

unsafe extern "C" fn visit(info: *mut DlPhdrInfo, _size: usize, data: *mut c_void) -> c_int {
    // SAFETY: `dl_iterate_phdr` passes a valid `info`, and `data` is the `Search`
    // `_dl_find_object` passed it, borrowed by nothing else meanwhile.
    let (info, search) = unsafe { (&*info, &mut *data.cast::<Search>()) };
    if info.phdr.is_null() {
        return 0;
    }
    // SAFETY: a non-null `phdr` holds `phnum` program headers.
    let phdrs = unsafe { std::slice::from_raw_parts(info.phdr, info.phnum.into()) };
    let (mut start, mut end, mut eh_frame) = (usize::MAX, 0, 0);
    for p in phdrs {
        let at = info.addr.wrapping_add(p.p_vaddr as usize);
        match p.p_type {
            PT_LOAD => {
                start = start.min(at);
                end = end.max(at.wrapping_add(p.p_memsz as usize));
            }
            PT_GNU_EH_FRAME => eh_frame = at,
            _ => {}
        }
    }
    if (start..end).contains(&search.pc) {
        (search.start, search.end, search.eh_frame) = (start, end, eh_frame);
        return 1;
    }
    0
}

/// glibc 2.35's lookup of the object holding `pc`, which gcc's unwinder (`libgcc_eh`, built
/// against glibc) calls to find unwind tables: for backtraces (`RUST_BACKTRACE`, and `anyhow`
/// capturing one for an error). Answered from the program headers `dl_iterate_phdr` reports;
/// without an answer the unwinder aborts the process instead of printing the error.
///
/// # Safety
///
/// `result` points to writable memory for one `DlFindObject` (the unwinder's own).
#[unsafe(no_mangle)]
unsafe extern "C" fn _dl_find_object(pc: *mut c_void, result: *mut DlFindObject) -> c_int {
    let mut search = Search { pc: pc as usize, start: 0, end: 0, eh_frame: 0 };
    // SAFETY: `visit` reads what `dl_iterate_phdr` passes and writes only `search`, which lives
    // across the call.
    let found = unsafe { dl_iterate_phdr(visit, (&raw mut search).cast()) };
    if found == 0 {
        return -1;
    }
    let object = DlFindObject {
        flags: 0,
        map_start: search.start as *mut c_void,
        map_end: search.end as *mut c_void,
        link_map: std::ptr::null_mut(),
        eh_frame: search.eh_frame as *mut c_void,
        reserved: [0; 7],
    };
    // SAFETY: the caller's contract.
    unsafe { result.write(object) };
    0
}
