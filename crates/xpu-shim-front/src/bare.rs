//! What libc's start-up and runtime would otherwise provide, for the build without libc
//! (`panic = "abort"`): the entry point `_start`, the self-relocation of a static-pie
//! executable, a bump allocator, the panic handler and the memory functions the compiler calls.
//!
//! The process lives for well under a millisecond and then execs, so the allocator never gives
//! memory back (except the last block, which lets a growing `Vec` grow in place) and nothing is
//! torn down.

use core::alloc::{GlobalAlloc, Layout};
use core::cell::UnsafeCell;
use core::ffi::{CStr, c_char};
use core::sync::atomic::{AtomicUsize, Ordering};

use alloc::vec::Vec;

/// The kernel's entry point: the stack holds `argc`, `argv[]`, `NULL`, `envp[]`, `NULL`.
#[unsafe(naked)]
#[unsafe(no_mangle)]
unsafe extern "C" fn _start() -> ! {
    core::arch::naked_asm!(
        "xor ebp, ebp",
        "mov rdi, rsp",
        "and rsp, -16",
        "call {entry}",
        "ud2",
        entry = sym entry,
    )
}

/// The arguments and environment as the kernel laid them out, for the panic handler.
static START: AtomicUsize = AtomicUsize::new(0);
/// The full shim's path (a leaked, NUL-terminated string) once found, for the panic handler.
static FULL_SHIM: AtomicUsize = AtomicUsize::new(0);

/// Keeps the full shim's path for the panic handler.
pub fn remember_full_shim(path: &[u8]) {
    if let Ok(c) = alloc::ffi::CString::new(path) {
        FULL_SHIM.store(
            alloc::boxed::Box::leak(c.into_boxed_c_str()).as_ptr() as usize,
            Ordering::Relaxed,
        );
    }
}

unsafe extern "C" fn entry(sp: *const usize) -> ! {
    // SAFETY: runs first, before anything reads a pointer stored in the image.
    unsafe { relocate() };
    START.store(sp as usize, Ordering::Relaxed);
    // SAFETY: `sp` is the initial stack the kernel built: argc, then argc pointers, a null,
    // then the environment's pointers up to a null, all to NUL-terminated strings that live as
    // long as the process.
    let (args, env) = unsafe { arguments(sp) };
    crate::run(&args[1.min(args.len())..], &env)
}

/// `argv` and `envp` from the initial stack at `sp`.
unsafe fn arguments(sp: *const usize) -> (Vec<&'static CStr>, Vec<&'static CStr>) {
    // SAFETY: see `entry`.
    unsafe {
        let argc = *sp;
        let argv = sp.add(1).cast::<*const c_char>();
        let args = (0..argc).map(|i| CStr::from_ptr(*argv.add(i))).collect();
        let mut env = Vec::new();
        let mut p = argv.add(argc + 1);
        while !(*p).is_null() {
            env.push(CStr::from_ptr(*p));
            p = p.add(1);
        }
        (args, env)
    }
}

const PT_DYNAMIC: u32 = 2;
const PT_GNU_RELRO: u32 = 0x6474_e552;
const DT_NULL: usize = 0;
const DT_RELA: usize = 7;
const DT_RELASZ: usize = 8;
const DT_RELRSZ: usize = 35;
const DT_RELR: usize = 36;
const R_X86_64_NONE: u64 = 0;
const R_X86_64_RELATIVE: u64 = 8;

/// Applies the image's relative relocations (the kernel loads a static-pie executable at a
/// random address and leaves them to the program), then makes the relocated read-only data
/// read-only (RELRO), as glibc's `_dl_relocate_static_pie` does. Reads no pointer from the
/// image before it is relocated: only addresses computed relative to the instruction pointer.
/// Any other relocation type means the link went wrong: exit at once rather than run with a
/// bad pointer.
unsafe fn relocate() {
    let ehdr: usize;
    let dynamic: usize;
    // SAFETY: `lea` of two symbols the linker defines in every static-pie executable.
    unsafe {
        core::arch::asm!(
            "lea {e}, [rip + __ehdr_start]",
            "lea {d}, [rip + _DYNAMIC]",
            e = out(reg) ehdr,
            d = out(reg) dynamic,
            options(nostack, pure, nomem),
        );
    }
    // SAFETY: the ELF header and the program headers are mapped (the first loaded segment
    // starts with them), and `_DYNAMIC` is the dynamic section, an array of (tag, value)
    // ending with DT_NULL. Relocation offsets are inside the image's writable segment.
    unsafe {
        let rd = |addr: usize| core::ptr::read_unaligned(addr as *const u64);
        let rd16 = |addr: usize| usize::from(core::ptr::read_unaligned(addr as *const u16));
        let phoff = rd(ehdr + 32) as usize;
        let (phentsize, phnum) = (rd16(ehdr + 54), rd16(ehdr + 56));
        let (mut dyn_vaddr, mut relro) = (None, None);
        for i in 0..phnum {
            let ph = ehdr + phoff + i * phentsize;
            let ty = core::ptr::read_unaligned(ph as *const u32);
            let (vaddr, memsz) = (rd(ph + 16) as usize, rd(ph + 40) as usize);
            if ty == PT_DYNAMIC {
                dyn_vaddr = Some(vaddr);
            } else if ty == PT_GNU_RELRO {
                relro = Some((vaddr, memsz));
            }
        }
        let Some(dyn_vaddr) = dyn_vaddr else { crate::sys::exit_group(127) };
        let base = dynamic.wrapping_sub(dyn_vaddr);
        let (mut rela, mut relasz, mut relr, mut relrsz) = (0, 0, 0, 0);
        let mut d = dynamic as *const usize;
        while *d != DT_NULL {
            let v = *d.add(1);
            match *d {
                DT_RELA => rela = v,
                DT_RELASZ => relasz = v,
                DT_RELR => relr = v,
                DT_RELRSZ => relrsz = v,
                _ => {}
            }
            d = d.add(2);
        }
        let mut r = base + rela;
        while r < base + rela + relasz {
            let (offset, info, addend) = (rd(r) as usize, rd(r + 8), rd(r + 16) as usize);
            match info & 0xffff_ffff {
                R_X86_64_RELATIVE => *((base + offset) as *mut usize) = base.wrapping_add(addend),
                R_X86_64_NONE => {}
                _ => crate::sys::exit_group(127),
            }
            r += 24;
        }
        // RELR: an address entry relocates one word and sets where the next bitmap starts;
        // a bitmap entry (low bit set) relocates the words its other 63 bits select.
        let mut at = 0usize;
        let mut e = base + relr;
        while e < base + relr + relrsz {
            let entry = rd(e) as usize;
            if entry & 1 == 0 {
                at = base + entry;
                *(at as *mut usize) += base;
                at += 8;
            } else {
                let mut bits = entry >> 1;
                let mut word = at;
                while bits != 0 {
                    if bits & 1 != 0 {
                        *(word as *mut usize) += base;
                    }
                    bits >>= 1;
                    word += 8;
                }
                at += 63 * 8;
            }
            e += 8;
        }
        if let Some((vaddr, memsz)) = relro {
            let page = 4096;
            let start = (base + vaddr) & !(page - 1);
            let end = (base + vaddr + memsz) & !(page - 1);
            // As glibc, a RELRO that cannot be applied is fatal.
            if end > start
                && rustix::mm::mprotect(
                    start as *mut core::ffi::c_void,
                    end - start,
                    rustix::mm::MprotectFlags::READ,
                )
                .is_err()
            {
                crate::sys::write_stderr(
                    b"xpu-container-runtime: error: cannot make the relocated data read-only\n",
                );
                crate::sys::exit_group(127);
            }
        }
    }
}

/// The allocator: a bump pointer through a static arena (its pages are mapped only when
/// touched), then through anonymous mappings. Single-threaded: the front starts no threads.
struct Bump;

#[repr(C, align(4096))]
struct Arena(UnsafeCell<[u8; ARENA]>);
// SAFETY: only the allocator touches the arena, and the process has one thread.
unsafe impl Sync for Arena {}

const ARENA: usize = 1 << 20;
/// The most the front maps beyond the arena; past it an allocation fails (the front then
/// panics, and the panic handler hands the command to the full shim).
const MAX_MAPPED: usize = 256 << 20;

static ARENA_MEM: Arena = Arena(UnsafeCell::new([0; ARENA]));
static NEXT: AtomicUsize = AtomicUsize::new(0);
static END: AtomicUsize = AtomicUsize::new(0);
static MAPPED: AtomicUsize = AtomicUsize::new(0);

#[global_allocator]
static ALLOCATOR: Bump = Bump;

// SAFETY: every block returned is `layout.size()` bytes aligned to `layout.align()`, inside the
// arena or a mapping of ours, and never handed out twice while live.
unsafe impl GlobalAlloc for Bump {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let (mut next, mut end) = (NEXT.load(Ordering::Relaxed), END.load(Ordering::Relaxed));
        if end == 0 {
            next = ARENA_MEM.0.get() as usize;
            end = next + ARENA;
        }
        let mut start = next.next_multiple_of(layout.align());
        if start.saturating_add(layout.size()) > end {
            let size = (layout.size() + layout.align()).next_multiple_of(1 << 20);
            if MAPPED.load(Ordering::Relaxed) + size > MAX_MAPPED {
                return core::ptr::null_mut();
            }
            // SAFETY: a fresh private anonymous mapping; nothing else refers to it.
            let Ok(p) = (unsafe {
                rustix::mm::mmap_anonymous(
                    core::ptr::null_mut(),
                    size,
                    rustix::mm::ProtFlags::READ | rustix::mm::ProtFlags::WRITE,
                    rustix::mm::MapFlags::PRIVATE,
                )
            }) else {
                return core::ptr::null_mut();
            };
            MAPPED.fetch_add(size, Ordering::Relaxed);
            end = p as usize + size;
            start = (p as usize).next_multiple_of(layout.align());
        }
        NEXT.store(start + layout.size(), Ordering::Relaxed);
        END.store(end, Ordering::Relaxed);
        start as *mut u8
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // The last block handed out goes back; for any other the exchange fails, on purpose:
        // they stay until the exec.
        let _ = NEXT.compare_exchange(
            ptr as usize + layout.size(),
            ptr as usize,
            Ordering::Relaxed,
            Ordering::Relaxed,
        );
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let (old_end, end) = (ptr as usize + layout.size(), END.load(Ordering::Relaxed));
        if NEXT.load(Ordering::Relaxed) == old_end && (ptr as usize).saturating_add(new_size) <= end
        {
            NEXT.store(ptr as usize + new_size, Ordering::Relaxed);
            return ptr;
        }
        // SAFETY: `new_size` with the old alignment is a valid layout (GlobalAlloc's contract).
        let new =
            unsafe { self.alloc(Layout::from_size_align_unchecked(new_size, layout.align())) };
        if !new.is_null() {
            // SAFETY: distinct blocks, the old one `layout.size()` bytes long.
            unsafe { core::ptr::copy_nonoverlapping(ptr, new, layout.size().min(new_size)) };
        }
        new
    }
}

/// A panic should not happen; if it does, say so and hand the command to the full shim (the
/// package's, if it was not found yet) with the arguments and environment the kernel gave us,
/// so that the container is still served. Allocates nothing (the panic may be an allocation
/// that failed), and a panic inside it ends the process.
#[panic_handler]
fn panic(info: &core::panic::PanicInfo<'_>) -> ! {
    static PANICKING: AtomicUsize = AtomicUsize::new(0);
    if PANICKING.swap(1, Ordering::Relaxed) != 0 {
        crate::sys::exit_group(127);
    }
    struct Stderr;
    impl core::fmt::Write for Stderr {
        fn write_str(&mut self, s: &str) -> core::fmt::Result {
            crate::sys::write_stderr(s.as_bytes());
            Ok(())
        }
    }
    // `Stderr` never fails, so neither does the formatting.
    let _ = core::fmt::Write::write_fmt(
        &mut Stderr,
        format_args!(
            "xpu-container-runtime: internal error: {info}; handing over to the full shim\n"
        ),
    );
    let sp = START.load(Ordering::Relaxed) as *mut usize;
    if !sp.is_null() {
        // SAFETY: `sp` is the initial stack (see `entry`): argv is a writable, null-terminated
        // array there, so argv[0] can be pointed at the full shim's path in place, and envp
        // follows it.
        unsafe {
            let argv = sp.add(1).cast::<*const u8>();
            let envp = argv.add(*sp + 1);
            let found = FULL_SHIM.load(Ordering::Relaxed) as *const c_char;
            let path = if found.is_null() {
                c"/usr/libexec/xpu/xpu-shim-std"
            } else {
                CStr::from_ptr(found)
            };
            if *sp > 0 {
                *argv = path.as_ptr().cast();
                // Returns only on failure, which ends in the exit below.
                let _ = crate::sys::execve(path, argv, envp);
            }
        }
    }
    crate::sys::exit_group(127)
}

/// The memory functions the compiler emits calls to, which libc would provide: `rep movsb` and
/// `rep stosb` (fast on every x86-64 with ERMS, and never turned back into a call).
#[unsafe(no_mangle)]
unsafe extern "C" fn memcpy(dst: *mut u8, src: *const u8, n: usize) -> *mut u8 {
    // SAFETY: the caller passes `n` valid bytes at each, not overlapping.
    unsafe {
        core::arch::asm!("rep movsb", inout("rcx") n => _, inout("rdi") dst => _,
            inout("rsi") src => _, options(nostack, preserves_flags));
    }
    dst
}

#[unsafe(no_mangle)]
unsafe extern "C" fn memmove(dst: *mut u8, src: *const u8, n: usize) -> *mut u8 {
    if (dst as usize).wrapping_sub(src as usize) >= n {
        // Forward copying is safe: `dst` is below `src` or past its end.
        // SAFETY: as for memcpy; a forward byte copy reads each byte before it is overwritten.
        unsafe { memcpy(dst, src, n) };
    } else {
        // SAFETY: backwards from the last byte, with the direction flag cleared again after.
        unsafe {
            core::arch::asm!("std", "rep movsb", "cld", inout("rcx") n => _,
                inout("rdi") dst.add(n).wrapping_sub(1) => _,
                inout("rsi") src.add(n).wrapping_sub(1) => _, options(nostack));
        }
    }
    dst
}

#[unsafe(no_mangle)]
unsafe extern "C" fn memset(dst: *mut u8, c: i32, n: usize) -> *mut u8 {
    // SAFETY: the caller passes `n` writable bytes at `dst`.
    unsafe {
        core::arch::asm!("rep stosb", inout("rcx") n => _, inout("rdi") dst => _,
            in("al") c as u8, options(nostack, preserves_flags));
    }
    dst
}

#[unsafe(no_mangle)]
unsafe extern "C" fn memcmp(a: *const u8, b: *const u8, n: usize) -> i32 {
    for i in 0..n {
        // SAFETY: the caller passes `n` readable bytes at each; volatile so the loop is not
        // recognised as a call to this very function.
        let (x, y) =
            unsafe { (core::ptr::read_volatile(a.add(i)), core::ptr::read_volatile(b.add(i))) };
        if x != y {
            return i32::from(x) - i32::from(y);
        }
    }
    0
}

#[unsafe(no_mangle)]
unsafe extern "C" fn bcmp(a: *const u8, b: *const u8, n: usize) -> i32 {
    // SAFETY: as for memcmp.
    unsafe { memcmp(a, b, n) }
}

#[unsafe(no_mangle)]
unsafe extern "C" fn strlen(s: *const c_char) -> usize {
    let mut n = 0;
    // SAFETY: the caller passes a NUL-terminated string.
    while unsafe { core::ptr::read_volatile(s.add(n)) } != 0 {
        n += 1;
    }
    n
}

/// The precompiled `alloc` library was built to unwind and names these; with `panic = "abort"`
/// nothing unwinds, so they are never called. Should one be, the process ends.
#[unsafe(no_mangle)]
extern "C" fn _Unwind_Resume() -> ! {
    crate::sys::exit_group(127)
}

#[unsafe(no_mangle)]
extern "C" fn rust_eh_personality() -> ! {
    crate::sys::exit_group(127)
}
