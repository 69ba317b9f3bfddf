//! The few system calls rustix keeps in its experimental runtime module (`execve`, signal state,
//! `exit_group`), made directly: x86-64 Linux, whose system call ABI is stable.

use core::arch::asm;
use core::ffi::CStr;

const SYS_RT_SIGACTION: usize = 13;
const SYS_RT_SIGPROCMASK: usize = 14;
const SYS_EXECVE: usize = 59;
const SYS_EXIT_GROUP: usize = 231;
const SIGPIPE: usize = 13;
const SIG_SETMASK: usize = 2;

/// A system call with up to four arguments; the kernel's return value (a negative errno on
/// failure).
///
/// # Safety
/// The arguments must be valid for system call `nr`.
unsafe fn syscall4(nr: usize, a: usize, b: usize, c: usize, d: usize) -> isize {
    let ret: isize;
    // SAFETY: the caller's; `syscall` clobbers rcx and r11 only.
    unsafe {
        asm!("syscall", inlateout("rax") nr as isize => ret, in("rdi") a, in("rsi") b,
            in("rdx") c, in("r10") d, lateout("rcx") _, lateout("r11") _, options(nostack));
    }
    ret
}

/// `execve(path, argv, envp)`; returns the errno when it fails.
///
/// # Safety
/// `argv` and `envp` must be null-terminated arrays of pointers to NUL-terminated strings.
pub unsafe fn execve(path: &CStr, argv: *const *const u8, envp: *const *const u8) -> i32 {
    // SAFETY: the caller's.
    let r =
        unsafe { syscall4(SYS_EXECVE, path.as_ptr() as usize, argv as usize, envp as usize, 0) };
    -(r as i32)
}

/// Writes `msg` to standard error. A failed write is not reported: there is nowhere left to
/// report it, and every caller exits or execs next.
pub fn write_stderr(msg: &[u8]) {
    // SAFETY: descriptor 2 is only written to; if it is closed the write fails.
    let fd = unsafe { rustix::fd::BorrowedFd::borrow_raw(2) };
    let _ = rustix::io::write(fd, msg);
}

/// Ends the process with `code`.
pub fn exit_group(code: i32) -> ! {
    // SAFETY: exit_group takes a plain integer and does not return.
    unsafe {
        asm!("syscall", in("rax") SYS_EXIT_GROUP, in("rdi") code as usize, options(noreturn, nostack));
    }
}

/// An empty signal mask and `SIGPIPE` at its default action: the state std gives a program it
/// runs (`Command::exec`).
pub fn reset_signals() {
    let empty: u64 = 0;
    // The kernel's `struct sigaction` on x86-64: handler, flags, restorer, mask; SIG_DFL is 0.
    let dfl: [u64; 4] = [0; 4];
    // SAFETY: both calls read only the values above (8-byte masks, as the kernel takes them)
    // and change only this process's signal state, just before it execs. With these constant
    // arguments they cannot fail; if one did, the runtime would start in the state the engine
    // gave us, as it would had the engine run it directly.
    unsafe {
        syscall4(SYS_RT_SIGPROCMASK, SIG_SETMASK, (&raw const empty) as usize, 0, 8);
        syscall4(SYS_RT_SIGACTION, SIGPIPE, dfl.as_ptr() as usize, 0, 8);
    }
}
