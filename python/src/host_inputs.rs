//! A CPU step's host inputs as slices: borrowed from the caller's memory, or copied first
//! where they share memory with one of the step's outputs (vLLM's drafter writes its hidden
//! rows over its input buffer; a shared slice may not alias a mutable one, and the CPU
//! engine reads every input before it writes an output, so the copy changes no result).

use specplan_runtime::cpu::engine::Ints;

/// `len` values of `T` at a caller's host address, or a copy of them.
pub(crate) struct HostIn<T: Copy> {
    own: Option<Vec<T>>,
    p: u64,
    len: usize,
}

impl<T: Copy> HostIn<T> {
    /// # Safety
    /// SAFETY: `p` is valid and aligned for reads of `len` values of `T` while the value
    /// lives, and when `copy` is false nothing writes that memory meanwhile (the caller
    /// checked it shares no byte with an output, nor with the registered K/V pool, which
    /// the step writes through raw pointers).
    pub(crate) unsafe fn new(p: u64, len: usize, copy: bool) -> HostIn<T> {
        // SAFETY: the constructor's contract; the slice is dropped once copied.
        let own = copy.then(|| unsafe { std::slice::from_raw_parts(p as *const T, len) }.to_vec());
        HostIn { own, p, len }
    }

    pub(crate) fn get(&self) -> &[T] {
        match &self.own {
            Some(v) => v,
            // SAFETY: `new`'s contract: valid, aligned, unwritten while `self` lives.
            None => unsafe { std::slice::from_raw_parts(self.p as *const T, self.len) },
        }
    }
}

/// An integer input of either width.
pub(crate) enum HostInts {
    I32(HostIn<i32>),
    I64(HostIn<i64>),
}

impl HostInts {
    /// # Safety
    /// SAFETY: as [`HostIn::new`], for `len` values of the width `i32` names.
    pub(crate) unsafe fn new(p: u64, i32: bool, len: usize, copy: bool) -> HostInts {
        // SAFETY: the constructor's contract.
        unsafe {
            if i32 {
                HostInts::I32(HostIn::new(p, len, copy))
            } else {
                HostInts::I64(HostIn::new(p, len, copy))
            }
        }
    }

    pub(crate) fn ints(&self) -> Ints<'_> {
        match self {
            HostInts::I32(x) => Ints::I32(x.get()),
            HostInts::I64(x) => Ints::I64(x.get()),
        }
    }
}
