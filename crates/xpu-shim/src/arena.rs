//! The shim's allocator: a bump pointer through a static arena, then the system allocator.
//!
//! The shim lives for a fraction of a millisecond and then execs the real runtime, so freeing is
//! mostly wasted work. A general-purpose `malloc` also costs system calls here: musl's
//! (`scripts/build-shim` links the shim with musl) maps and remaps every larger block, about a
//! hundred `mmap`, `mremap` and `munmap` calls for one request, a quarter of a millisecond. The
//! arena is in `.bss`, so its pages cost nothing until touched, and a request touches a few
//! hundred KiB of it.
//!
//! A block freed or resized while it is the last one handed out is given back or grown in place;
//! any other freed block stays until the exec. Past the arena, and for every block that does
//! not fit what is left of it, the system allocator serves: a spec or snapshot far larger than
//! usual still works, only slower. Thread-safe (a compare-and-swap on the bump offset), though
//! the shim starts no threads.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicUsize, Ordering};

/// The arena's size: a request with a large spec uses a few MiB at most.
const SIZE: usize = 32 << 20;

#[repr(C, align(4096))]
struct Memory(UnsafeCell<[u8; SIZE]>);

// SAFETY: the arena's bytes are only reached through blocks the allocator hands out, each to one
// owner; the offset that divides them is atomic.
unsafe impl Sync for Memory {}

static MEMORY: Memory = Memory(UnsafeCell::new([0; SIZE]));
/// The offset of the first byte not handed out.
static NEXT: AtomicUsize = AtomicUsize::new(0);

/// The global allocator of `xpu-container-runtime` (the binary only: `xpu runtime` keeps the system's).
pub struct Arena;

fn base() -> usize {
    MEMORY.0.get() as usize
}

/// The offset of `ptr` in the arena, when it points into it.
fn offset(ptr: *mut u8) -> Option<usize> {
    let off = (ptr as usize).wrapping_sub(base());
    (off < SIZE).then_some(off)
}

/// A block of `layout` from the arena, or `None` when what is left cannot hold it.
fn bump(layout: Layout) -> Option<*mut u8> {
    let mut next = NEXT.load(Ordering::Relaxed);
    loop {
        let start = (base() + next).checked_next_multiple_of(layout.align())? - base();
        let end = start.checked_add(layout.size()).filter(|&e| e <= SIZE)?;
        match NEXT.compare_exchange_weak(next, end, Ordering::Relaxed, Ordering::Relaxed) {
            Ok(_) => return Some((base() + start) as *mut u8),
            Err(now) => next = now,
        }
    }
}

// SAFETY: an arena block is `layout.size()` bytes at `layout.align()` inside the arena, and the
// compare-and-swap on `NEXT` hands each byte to one block at a time: a block is given back (the
// offset moved down over it) only while no block after it exists. Every other block comes from,
// and goes back to, `System`, which `offset` tells apart by address.
unsafe impl GlobalAlloc for Arena {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        match bump(layout) {
            Some(p) => p,
            // SAFETY: the caller's layout, passed on (GlobalAlloc's contract).
            None => unsafe { System.alloc(layout) },
        }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        match offset(ptr) {
            // The last block goes back; for any other the exchange fails, on purpose.
            Some(off) => {
                let _ = NEXT.compare_exchange(
                    off + layout.size(),
                    off,
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                );
            }
            // SAFETY: a block `System` handed out with this layout.
            None => unsafe { System.dealloc(ptr, layout) },
        }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let Some(off) = offset(ptr) else {
            // SAFETY: a block `System` handed out with this layout (GlobalAlloc's contract).
            return unsafe { System.realloc(ptr, layout, new_size) };
        };
        // The last block grows or shrinks in place while the arena holds it.
        if off + new_size <= SIZE
            && NEXT
                .compare_exchange(
                    off + layout.size(),
                    off + new_size,
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                )
                .is_ok()
        {
            return ptr;
        }
        // SAFETY: `new_size` with the old alignment is a valid layout (GlobalAlloc's contract).
        let new_layout = unsafe { Layout::from_size_align_unchecked(new_size, layout.align()) };
        // SAFETY: a valid, non-zero-sized layout.
        let new = unsafe { self.alloc(new_layout) };
        if !new.is_null() {
            // SAFETY: distinct blocks, the old one `layout.size()` bytes long; the old block is
            // then freed with its own layout.
            unsafe {
                std::ptr::copy_nonoverlapping(ptr, new, layout.size().min(new_size));
                self.dealloc(ptr, layout);
            }
        }
        new
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    /// Blocks are aligned, disjoint and keep their bytes; the last one grows in place and goes
    /// back when freed; a block larger than the arena comes from the system allocator.
    #[test]
    fn blocks_are_aligned_disjoint_and_the_last_one_is_reused() {
        // The test harness allocates through the system allocator, not this one: only the
        // calls below touch the arena.
        let a = Arena;
        let l8 = Layout::from_size_align(24, 8).unwrap();
        let l64 = Layout::from_size_align(100, 64).unwrap();
        // SAFETY: non-zero layouts; each block is freed once, with its layout.
        unsafe {
            let p = a.alloc(l8);
            let q = a.alloc(l64);
            assert_eq!(q as usize % 64, 0);
            assert!(q as usize >= p as usize + 24);
            p.write_bytes(0xaa, 24);
            q.write_bytes(0x55, 100);
            // `q` is last: it grows in place.
            let q2 = a.realloc(q, l64, 4096);
            assert_eq!(q2, q);
            assert_eq!(*q2.add(99), 0x55);
            // `p` is not last: it moves, and keeps its bytes.
            let p2 = a.realloc(p, l8, 48);
            assert_ne!(p2, p);
            assert_eq!(*p2.add(23), 0xaa);
            // Freeing the last block gives it back: the next allocation reuses the address.
            let l48 = Layout::from_size_align(48, 8).unwrap();
            a.dealloc(p2, l48);
            let p3 = a.alloc(l48);
            assert_eq!(p3, p2);
            a.dealloc(p3, l48);
            a.dealloc(q2, Layout::from_size_align(4096, 64).unwrap());
            let big = Layout::from_size_align(SIZE + 1, 8).unwrap();
            let b = a.alloc(big);
            assert!(!b.is_null() && offset(b).is_none());
            b.add(SIZE).write(1);
            a.dealloc(b, big);
        }
    }
}
