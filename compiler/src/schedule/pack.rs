//! Step 2 of scheduling: arena offsets. Inputs first and contiguous, in the order host prep
//! stages them (the integer inputs, then the hidden states), so one copy moves them all;
//! they are live for the whole step anyway, so this costs no reuse. Then greedy packing of
//! the rest: largest first, lowest offset clear of every intersecting live range.

use specplan_format::{io, BufferDesc, BufferRole};

use super::liveness::Item;

const ALIGN: u64 = 256;

/// Where the inputs sit at the start of the arena.
pub const INPUT_ORDER: [&str; 5] = [
    io::INPUT_IDS,
    io::PREFIX_LENS,
    io::ACCEPT_LENS,
    io::REQ_SLOTS,
    io::HIDDEN_STATES,
];

fn padded(it: &Item) -> u64 {
    it.bytes().div_ceil(ALIGN) * ALIGN
}

/// Buffers at their offsets (in `items` order) and the arena size.
pub(super) fn pack(items: &[Item]) -> (Vec<BufferDesc>, u64) {
    let mut offsets = vec![0u64; items.len()];
    let mut placed: Vec<usize> = Vec::new();
    let mut arena = 0u64;
    for name in INPUT_ORDER {
        if let Some(i) = items
            .iter()
            .position(|it| it.name == name && it.role == BufferRole::Input)
        {
            offsets[i] = arena;
            arena += padded(&items[i]);
            placed.push(i);
        }
    }
    let mut by_size: Vec<usize> = (0..items.len()).filter(|i| !placed.contains(i)).collect();
    by_size.sort_by_key(|&i| (std::cmp::Reverse(items[i].bytes()), items[i].first, i));
    for &i in &by_size {
        let size = padded(&items[i]);
        let mut busy: Vec<(u64, u64)> = placed
            .iter()
            .filter(|&&j| items[j].first <= items[i].last && items[i].first <= items[j].last)
            .map(|&j| (offsets[j], offsets[j] + padded(&items[j])))
            .collect();
        busy.sort();
        let mut at = 0u64;
        for (lo, hi) in busy {
            if at + size <= lo {
                break;
            }
            at = at.max(hi);
        }
        offsets[i] = at;
        arena = arena.max(at + size);
        placed.push(i);
    }
    let buffers = items
        .iter()
        .zip(&offsets)
        .map(|(it, &offset)| BufferDesc {
            name: it.name.clone(),
            dtype: it.dtype,
            shape: it.shape.clone(),
            offset,
            bytes: it.bytes(),
            role: it.role,
        })
        .collect();
    (buffers, arena)
}
