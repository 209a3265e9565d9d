//! What the device refused: [`DeviceError`] (a step's refusal words decoded), and the two
//! ways to read them — `last_error` (waits for the last step) and `poll_error` (reads the
//! host-mapped ring `emit` fills, without a wait or a copy).

use cudarc::driver::result;
use specplan_kernels::kv::{self, DeviceRule};

use super::device::{cuda, GpuError};
use super::{GpuRuntime, Mode};

/// What [`GpuRuntime::poll_error`] knows about the last step without waiting.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StepPoll {
    /// Every step has been reported (or none has run).
    Idle,
    /// The steps that finished since the last poll refused these (oldest first; empty:
    /// nothing refused); `pending`: a later step is still on the device.
    Done {
        refused: Vec<DeviceError>,
        pending: bool,
        lost: u32,
    },
}

/// What the device rules refused in the last step.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceError {
    /// Requests refused (each wrote nothing: no K/V, zero output rows) or flagged for
    /// non-finite outputs.
    pub count: u64,
    /// The lowest such request index of the step (in the whole batch) and the rule it
    /// broke.
    pub request: u64,
    pub rule: Option<DeviceRule>,
    /// For [`DeviceRule::Alias`]: the request writing a slot it reads (itself when it
    /// writes one slot at two positions).
    pub other: Option<u64>,
}

impl DeviceError {
    /// The report of the status words `[count, first, other]` of the step tagged `epoch`.
    pub fn from_words(words: [u64; 3], epoch: u32) -> Option<DeviceError> {
        kv::step_refusals(words, epoch).map(|r| DeviceError {
            count: r.count,
            request: r.request,
            rule: DeviceRule::from_code(r.rule),
            other: r.other,
        })
    }
}

impl std::fmt::Display for DeviceError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let rule = self.rule.map_or("an unknown rule", |r| r.describe());
        write!(
            f,
            "{} request(s) refused or flagged on the device; request {}",
            self.count, self.request
        )?;
        if let Some(o) = self.other {
            if o == self.request {
                write!(f, " (with itself: two of its positions share a slot)")?;
            } else {
                write!(f, " (with request {o}, which writes a slot it reads)")?;
            }
        }
        write!(f, ": {rule}")
    }
}

impl GpuRuntime {
    /// What the device rules refused in the last step (`None`: nothing, or no step yet).
    /// Waits for the last step to finish (an event recorded at its end).
    pub fn last_error(&self) -> Result<Option<DeviceError>, GpuError> {
        let e = self.engine()?;
        if e.epoch == 0 {
            return Ok(None);
        }
        cuda("cuCtxSetCurrent", self.ctx.bind_to_thread())?;
        // SAFETY: the runtime's event, recorded by the last step.
        cuda("cuEventSynchronize", unsafe { result::event::synchronize(e.done.0) })?;
        let mut words = [0u64; kv::STATUS_WORDS];
        // SAFETY: the runtime's status words; the last step that writes them is done.
        cuda("cuMemcpyDtoH", unsafe {
            result::memcpy_dtoh_sync(&mut words, self.mem.status_ptr())
        })?;
        Ok(DeviceError::from_words(
            [
                words[kv::STATUS_ERR_COUNT],
                words[kv::STATUS_ERR_FIRST],
                words[kv::STATUS_ERR_OTHER],
            ],
            e.epoch,
        ))
    }

    /// What the device rules refused in the steps that finished since the last poll,
    /// without waiting: `emit` leaves each step's refusal words in a host-mapped ring
    /// tagged with the step, so this reads memory only — no synchronization and no copy —
    /// and an engine may call it on its replay path (before each step, say). A step not yet
    /// finished stops the poll (`pending`; a later poll reports it); a finished step whose
    /// slot a step [`kv::MIRROR_SLOTS`] later has overwritten before the poll is counted
    /// in `lost`.
    pub fn poll_error(&mut self) -> Result<StepPoll, GpuError> {
        let Mode::Engine(e) = &mut self.mode else {
            return Err(GpuError::Mode("an engine-memory step"));
        };
        if e.epoch == e.polled {
            return Ok(StepPoll::Idle);
        }
        // Epochs restart at 1 after u32::MAX - 1: a poll older than the wrap restarts too.
        if e.polled > e.epoch {
            e.polled = 0;
        }
        let slots = kv::MIRROR_SLOTS as u32;
        let mut lost = 0;
        let mut refused = Vec::new();
        let mut pending = false;
        let m = &self.mem.mirror;
        while e.polled < e.epoch {
            let next = e.polled + 1;
            let at = kv::MIRROR_WORDS * (next % slots) as usize;
            let tag = m.read(at);
            if tag < next as u64 {
                // Not finished yet (a host far ahead of the device is not a loss: the
                // slot still holds an older step's words).
                pending = true;
                break;
            }
            if tag == next as u64 {
                // The tag was written after the words and a system-wide fence.
                std::sync::atomic::fence(std::sync::atomic::Ordering::Acquire);
                let words = [m.read(at + 1), m.read(at + 2), m.read(at + 3)];
                std::sync::atomic::fence(std::sync::atomic::Ordering::Acquire);
                // Unchanged tag: the words are this step's (a later step writes its words
                // before its tag).
                if m.read(at) == next as u64 {
                    refused.extend(DeviceError::from_words(words, next));
                } else {
                    lost += 1;
                }
            } else {
                // A later step has overwritten the slot before this poll.
                lost += 1;
            }
            e.polled = next;
        }
        Ok(StepPoll::Done { refused, pending, lost })
    }
}
