//! `memcpy`, `memmove`, `memcmp` and `bcmp` for the musl build (`--cfg xpu_musl`), in place of
//! musl's. Parsing and rewriting a spec makes about two thousand calls, nearly all of a few
//! bytes: musl's `memcpy` starts `rep movsq` (tens of cycles to start) or copies byte by byte,
//! and its `memcmp` compares byte by byte; they were a quarter of the shim's time in user space.
//! Here a block of up to 64 bytes is copied with two overlapping loads and two stores of the
//! widest width that fits (both loads first, so the same code serves `memmove`), a longer one
//! with `rep movsb`, which CPUs with fast string operations run at full speed; comparisons go
//! eight bytes at a time.
//!
//! The functions are plain Rust (tested on every build); only the musl build exports them under
//! the C names. Their bodies call nothing: no loop here copies or compares bytewise in a way the
//! compiler could turn back into a call to the function being defined.

use std::arch::asm;

/// `n` bytes from `src` to `dst`, `n <= 64`. Every byte is loaded before the first store, so
/// the blocks may overlap.
///
/// # Safety
/// `src` is readable and `dst` writable for `n` bytes.
#[inline(always)]
unsafe fn copy_small(dst: *mut u8, src: *const u8, n: usize) {
    // SAFETY: the caller's buffers; each width is at most `n`, and the accesses of the first
    // arm are inside them too.
    unsafe {
        match n {
            // Four 16-byte loads, then four stores: `copy_ends` of a 32-byte array would spill
            // through the stack.
            32.. => {
                let a = src.cast::<u128>().read_unaligned();
                let b = src.add(16).cast::<u128>().read_unaligned();
                let c = src.add(n - 32).cast::<u128>().read_unaligned();
                let d = src.add(n - 16).cast::<u128>().read_unaligned();
                dst.cast::<u128>().write_unaligned(a);
                dst.add(16).cast::<u128>().write_unaligned(b);
                dst.add(n - 32).cast::<u128>().write_unaligned(c);
                dst.add(n - 16).cast::<u128>().write_unaligned(d);
            }
            16.. => copy_ends::<u128>(dst, src, n),
            8.. => copy_ends::<u64>(dst, src, n),
            4.. => copy_ends::<u32>(dst, src, n),
            2.. => copy_ends::<u16>(dst, src, n),
            1 => dst.write(src.read()),
            0 => {}
        }
    }
}

/// `n` bytes as the first and the last `size_of::<T>()` of them, which overlap unless `n` is
/// twice that: both loads before both stores.
///
/// # Safety
/// `src` is readable and `dst` writable for `n` bytes, and `size_of::<T>() <= n`.
#[inline(always)]
unsafe fn copy_ends<T: Copy>(dst: *mut u8, src: *const u8, n: usize) {
    let tail = n - size_of::<T>();
    // SAFETY: both accesses are inside the caller's `n` bytes; unaligned accesses are allowed.
    unsafe {
        let head = src.cast::<T>().read_unaligned();
        let last = src.add(tail).cast::<T>().read_unaligned();
        dst.cast::<T>().write_unaligned(head);
        dst.add(tail).cast::<T>().write_unaligned(last);
    }
}

/// `rep movsb`: `n` bytes from `src` to `dst`, forwards (lowest address first).
///
/// # Safety
/// As for `memcpy`; the blocks may overlap only with `dst` below `src`.
#[inline(always)]
unsafe fn rep_movsb(dst: *mut u8, src: *const u8, n: usize) {
    // SAFETY: the caller's buffers; the direction flag is clear, as the ABI requires at calls.
    unsafe {
        asm!(
            "rep movsb",
            inout("rcx") n => _,
            inout("rdi") dst => _,
            inout("rsi") src => _,
            options(nostack, preserves_flags)
        );
    }
}

/// `memcpy`.
///
/// # Safety
/// `src` readable and `dst` writable for `n` bytes, not overlapping.
#[cfg_attr(xpu_musl, unsafe(no_mangle))]
pub unsafe extern "C" fn memcpy(dst: *mut u8, src: *const u8, n: usize) -> *mut u8 {
    // SAFETY: the caller's buffers.
    unsafe {
        if n <= 64 {
            copy_small(dst, src, n);
        } else {
            rep_movsb(dst, src, n);
        }
    }
    dst
}

/// `memmove`.
///
/// # Safety
/// `src` readable and `dst` writable for `n` bytes; they may overlap.
#[cfg_attr(xpu_musl, unsafe(no_mangle))]
pub unsafe extern "C" fn memmove(dst: *mut u8, src: *const u8, n: usize) -> *mut u8 {
    // SAFETY: the caller's buffers. A forward copy is right unless `dst` starts inside the
    // source after its first byte; then the copy runs backwards (direction flag set for the
    // one instruction, cleared after).
    unsafe {
        if n <= 64 {
            copy_small(dst, src, n);
        } else if (dst as usize).wrapping_sub(src as usize) >= n {
            rep_movsb(dst, src, n);
        } else {
            asm!(
                "std",
                "rep movsb",
                "cld",
                inout("rcx") n => _,
                inout("rdi") dst.add(n - 1) => _,
                inout("rsi") src.add(n - 1) => _,
                options(nostack)
            );
        }
    }
    dst
}

/// `memcmp`: the sign of the first differing byte pair (as unsigned bytes), 0 when equal.
///
/// # Safety
/// `a` and `b` readable for `n` bytes.
#[cfg_attr(xpu_musl, unsafe(no_mangle))]
pub unsafe extern "C" fn memcmp(a: *const u8, b: *const u8, n: usize) -> i32 {
    let mut i = 0;
    // SAFETY: every access is below `n`.
    unsafe {
        while i + 8 <= n {
            let x = a.add(i).cast::<u64>().read_unaligned();
            let y = b.add(i).cast::<u64>().read_unaligned();
            if x != y {
                // Big-endian order makes the first byte the most significant.
                return if u64::from_be(x) < u64::from_be(y) { -1 } else { 1 };
            }
            i += 8;
        }
        while i < n {
            let (x, y) = (a.add(i).read(), b.add(i).read());
            if x != y {
                return i32::from(x) - i32::from(y);
            }
            i += 1;
        }
    }
    0
}

/// `bcmp`: 0 when equal, else not 0 (what `==` on byte slices compiles to).
///
/// # Safety
/// `a` and `b` readable for `n` bytes.
#[cfg_attr(xpu_musl, unsafe(no_mangle))]
pub unsafe extern "C" fn bcmp(a: *const u8, b: *const u8, n: usize) -> i32 {
    // SAFETY: the caller's buffers.
    unsafe { memcmp(a, b, n) }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pattern(n: usize) -> Vec<u8> {
        (0..n).map(|i| (i * 7 + 3) as u8).collect()
    }

    /// Every length up to 300 (each branch and its edges), at every alignment of 0..8.
    #[test]
    fn copies_like_slices() {
        for n in 0..300 {
            for off in 0..8 {
                let src = pattern(n + off);
                let mut dst = vec![0xeeu8; n + 16];
                // SAFETY: both buffers hold `n` bytes past the offsets.
                unsafe { memcpy(dst.as_mut_ptr().add(off), src.as_ptr().add(off), n) };
                assert_eq!(&dst[off..off + n], &src[off..off + n], "memcpy n={n} off={off}");
                assert!(dst[..off].iter().chain(&dst[off + n..]).all(|&b| b == 0xee));
            }
        }
    }

    /// Overlapping moves both ways, against `copy_within`.
    #[test]
    fn moves_like_copy_within() {
        for n in 0..200 {
            for shift in [1usize, 3, 8, 17, 64, 100] {
                let base = pattern(n + shift);
                let mut want = base.clone();
                want.copy_within(0..n, shift);
                let mut got = base.clone();
                // SAFETY: `n + shift` bytes, the blocks inside them.
                unsafe { memmove(got.as_mut_ptr().add(shift), got.as_ptr(), n) };
                assert_eq!(got, want, "up n={n} shift={shift}");
                let mut want = base.clone();
                want.copy_within(shift..shift + n, 0);
                let mut got = base;
                // SAFETY: as above.
                unsafe { memmove(got.as_mut_ptr(), got.as_ptr().add(shift), n) };
                assert_eq!(got, want, "down n={n} shift={shift}");
            }
        }
    }

    /// The sign matches `Ord` on byte slices, for a difference at every position.
    #[test]
    fn compares_like_slices() {
        for n in 0..40 {
            let a = pattern(n);
            // SAFETY: `n` bytes each.
            assert_eq!(unsafe { memcmp(a.as_ptr(), a.clone().as_ptr(), n) }, 0);
            for i in 0..n {
                for delta in [1u8, 0x80, 0xff] {
                    let mut b = a.clone();
                    b[i] = b[i].wrapping_add(delta);
                    let want = a.cmp(&b) as i32;
                    // SAFETY: `n` bytes each.
                    let got = unsafe { memcmp(a.as_ptr(), b.as_ptr(), n) };
                    assert_eq!(got.signum(), want, "n={n} i={i} delta={delta}");
                    // SAFETY: as above.
                    assert_ne!(unsafe { bcmp(a.as_ptr(), b.as_ptr(), n) }, 0);
                }
            }
        }
    }
}
