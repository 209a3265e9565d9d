//! The aliasing rule (`kv::DeviceRule::Alias`, admission rule 8), on the host: within one
//! replay, no request may read a cache slot that another (request, position) writes. The
//! requests of a replay run concurrently, so such a read races with the write (and two
//! writers of one slot race with each other); a row that maps two of its positions to one
//! slot corrupts its own context the same way.
//!
//! A request reads the slots of its positions `0 .. L+N−1` and writes those of `L .. L+N−1`.
//! The writes W are those of the requests that pass every other rule; request `i` is
//! refused when a slot it reads at position `q` has a writer other than `(i, q)`. The
//! device's `admit` applies the same rule (io.cu) with a write set in shared memory; this
//! is its twin for the CPU engine and the file contract. Work is O(Σ (L + N)): a request's
//! whole row, which the attention reads anyway.

use std::collections::HashMap;

/// One request of a replay: its prefix `l` and whether it passed the other rules (only
/// those write and are checked).
#[derive(Clone, Copy, Debug)]
pub struct Request {
    pub l: usize,
    pub admitted: bool,
}

/// A reader refused by the rule: the position it reads, the slot, and one request writing
/// that slot (the reader itself when two of its positions share it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Alias {
    pub position: usize,
    pub slot: u64,
    pub writer: usize,
}

/// For each request, the alias it reads with the lowest writer (`None`: none, or not
/// admitted). `slot(i, p)`
/// is the cache slot of position `p` of request `i` (`None`: no slot, never a write of an
/// admitted request).
pub fn check(reqs: &[Request], n: usize, slot: impl Fn(usize, usize) -> Option<u64>) -> Vec<Option<Alias>> {
    // slot → its writers (request, position), at most two kept: enough to tell a reader it
    // is not the only writer and name another.
    let mut w: HashMap<u64, [(usize, usize); 2]> = HashMap::new();
    const NONE: (usize, usize) = (usize::MAX, usize::MAX);
    for (j, r) in reqs.iter().enumerate().filter(|(_, r)| r.admitted) {
        for p in r.l..r.l + n {
            if let Some(s) = slot(j, p) {
                let e = w.entry(s).or_insert([NONE, NONE]);
                if e[0] == NONE {
                    e[0] = (j, p);
                } else if e[1] == NONE {
                    e[1] = (j, p);
                }
            }
        }
    }
    reqs.iter()
        .enumerate()
        .map(|(i, r)| {
            if !r.admitted {
                return None;
            }
            // The lowest writer over all its reads (as the device's atomicMin), at the
            // first position it is met.
            (0..r.l + n)
                .filter_map(|q| {
                    let s = slot(i, q)?;
                    let writers = w.get(&s)?;
                    let other = writers.iter().find(|&&x| x != NONE && x != (i, q))?;
                    Some(Alias {
                        position: q,
                        slot: s,
                        writer: other.0,
                    })
                })
                .min_by_key(|a| (a.writer, a.position))
        })
        .collect()
}

/// One request of a replay given by the positions it reads and writes (draft decode's
/// lanes: the prefix and the lanes' own slots read, the lanes' slots written).
#[derive(Clone, Debug)]
pub struct Sets {
    pub reads: Vec<usize>,
    pub writes: Vec<usize>,
    pub admitted: bool,
}

/// [`check`] over explicit position sets: request `i` is refused when a slot it reads at
/// position `q` has a writer other than `(i, q)`, naming the lowest such writer.
pub fn check_sets(reqs: &[Sets], slot: impl Fn(usize, usize) -> Option<u64>) -> Vec<Option<Alias>> {
    const NONE: (usize, usize) = (usize::MAX, usize::MAX);
    let mut w: HashMap<u64, [(usize, usize); 2]> = HashMap::new();
    for (j, r) in reqs.iter().enumerate().filter(|(_, r)| r.admitted) {
        for &p in &r.writes {
            if let Some(s) = slot(j, p) {
                let e = w.entry(s).or_insert([NONE, NONE]);
                if e[0] == NONE {
                    e[0] = (j, p);
                } else if e[1] == NONE {
                    e[1] = (j, p);
                }
            }
        }
    }
    reqs.iter()
        .enumerate()
        .map(|(i, r)| {
            if !r.admitted {
                return None;
            }
            r.reads
                .iter()
                .filter_map(|&q| {
                    let s = slot(i, q)?;
                    let other = w.get(&s)?.iter().find(|&&x| x != NONE && x != (i, q))?;
                    Some(Alias {
                        position: q,
                        slot: s,
                        writer: other.0,
                    })
                })
                .min_by_key(|a| (a.writer, a.position))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(l: usize) -> Request {
        Request { l, admitted: true }
    }

    #[test]
    fn reads_of_another_requests_new_slot_are_refused() {
        // Token slots: request 0 holds 0..=5 (L 2, N 4: writes 2..=5); request 1's row maps
        // its position 1 to slot 3, which request 0 writes.
        let rows = [vec![0u64, 1, 2, 3, 4, 5], vec![10, 3, 12, 13, 14, 15]];
        let got = check(&[req(2), req(2)], 4, |i, p| rows[i].get(p).copied());
        assert_eq!(got[0], None, "request 0 reads only its own slots");
        assert_eq!(
            got[1],
            Some(Alias {
                position: 1,
                slot: 3,
                writer: 0
            })
        );
    }

    #[test]
    fn shared_prefixes_are_read_read_and_pass() {
        // Both rows share slots 0, 1 (a cached prefix) and write distinct slots.
        let rows = [vec![0u64, 1, 2, 3], vec![0, 1, 6, 7]];
        let got = check(&[req(2), req(2)], 2, |i, p| rows[i].get(p).copied());
        assert_eq!(got, vec![None, None]);
    }

    #[test]
    fn own_duplicates_and_double_writes_are_refused() {
        // Request 0 maps positions 0 and 3 to slot 5 (it writes 3): it reads its own write
        // at another position.
        let own = [vec![5u64, 1, 2, 5]];
        let got = check(&[req(2)], 2, |i, p| own[i].get(p).copied());
        assert_eq!(got[0].map(|a| (a.position, a.writer)), Some((0, 0)));
        // Two requests write slot 9: both are refused, each naming the other.
        let rows = [vec![0u64, 9], vec![4, 9]];
        let got = check(&[req(1), req(1)], 1, |i, p| rows[i].get(p).copied());
        assert_eq!(got[0].map(|a| a.writer), Some(1));
        assert_eq!(got[1].map(|a| a.writer), Some(0));
    }

    #[test]
    fn explicit_sets_follow_the_same_rule() {
        // Lanes: request 0 writes positions 2 and 4 (slots 2, 4); request 1 reads its prefix
        // position 0 at slot 4 (request 0's write), request 2 only its own.
        let rows = [vec![0u64, 1, 2, 3, 4], vec![4, 9, 10], vec![20, 21, 22]];
        let sets = [
            Sets {
                reads: vec![0, 1, 2, 4],
                writes: vec![2, 4],
                admitted: true,
            },
            Sets {
                reads: vec![0, 2],
                writes: vec![2],
                admitted: true,
            },
            Sets {
                reads: vec![0, 1, 2],
                writes: vec![1, 2],
                admitted: true,
            },
        ];
        let got = check_sets(&sets, |i, p| rows[i].get(p).copied());
        assert_eq!(got[0], None);
        assert_eq!(got[1].map(|a| (a.position, a.slot, a.writer)), Some((0, 4, 0)));
        assert_eq!(got[2], None);
    }

    #[test]
    fn refused_requests_neither_write_nor_are_checked() {
        let rows = [vec![0u64, 1, 2, 3], vec![3, 8]];
        let mut reqs = [req(2), req(0)];
        reqs[0].admitted = false;
        assert_eq!(check(&reqs, 2, |i, p| rows[i].get(p).copied()), vec![None, None]);
    }
}
