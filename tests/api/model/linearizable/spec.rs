//! The sequential specification of docs/contract.md that the recorded histories are checked
//! against: one [`KeySpec`] per key and one [`EventsSpec`] for the events, each a stateright
//! `SequentialSpec`.
//!
//! Time. Every operation carries the window, by the database clock, in which its linearization
//! point must lie: `[lo, hi]`, the database clock just before the call was sent and just after its
//! answer came (see `history.rs` for how they are measured). The spec never guesses an instant:
//! each answer either pins it (a new lease is `t + ttl`, a completion is stamped `t`) or bounds it
//! (`in_progress` needs `t` before the lease's end; `absent` needs `t` at or past the retention's
//! end), and a step is valid exactly when some `t` in the window satisfies every bound. The spec
//! then remembers the earliest such `t` as its `floor`: a later operation in the same order may
//! not go back before it (less [`ORDER_SLACK`]). Choosing the earliest instant can never reject a
//! history that a later choice would accept, because every later constraint on order is a lower
//! bound. So the check is sound (a linearizable history always passes) while every timestamp in
//! an answer is still computed, never only repeated.

use stateright::semantics::SequentialSpec;

/// Microseconds since the epoch, by the database clock.
pub type Micros = i64;

/// How far a linearization point may lie before the one of an operation ordered before it. A
/// statement reads the clock before its commit becomes visible, and a snapshot read (Lookup) that
/// starts in between is ordered before it while reading a later instant; the gap is the commit
/// latency, which on a loaded machine can be long. It bounds only order, never a computed value.
pub const ORDER_SLACK: Micros = 1_000_000;

/// The server's defaults, which the runner starts it with.
pub const DEFAULT_LEASE_US: Micros = 30_000_000;
pub const DEFAULT_KEY_RETENTION_US: Micros = 24 * 3600 * 1_000_000;
pub const DEFAULT_EVENT_RETENTION_US: Micros = 7 * 24 * 3600 * 1_000_000;

/// The instants an operation may have been linearized at.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Window {
    pub lo: Micros,
    pub hi: Micros,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum KeyOp {
    TryStart {
        fingerprint: u8,
        attempt_id: &'static str,
        lease_us: Micros,
        retention_us: Micros,
    },
    Complete {
        token: u64,
        response: u8,
        retention_us: Option<Micros>,
    },
    Release {
        token: u64,
    },
    ExtendLease {
        token: u64,
        lease_us: Micros,
        checkpoint: Option<Vec<u8>>,
    },
    Lookup,
}

/// A refusal, by its ErrorInfo reason (each reason has one code; the runner checks both).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Refusal {
    KeyNotFound,
    LeaseLost,
    AlreadyCompleted,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum KeyRet {
    Started {
        token: u64,
        lease_expires_at: Micros,
        attempt: u32,
        checkpoint: Option<Vec<u8>>,
    },
    InProgress {
        lease_expires_at: Micros,
        attempt: u32,
    },
    Replayed {
        response: u8,
        completed_at: Micros,
        expires_at: Micros,
    },
    Mismatch,
    Completed {
        completed_at: Micros,
        expires_at: Micros,
    },
    Released,
    Extended {
        lease_expires_at: Micros,
    },
    Absent,
    LookedUpInProgress {
        lease_expires_at: Micros,
        attempt: u32,
        fingerprint: u8,
    },
    LookedUpCompleted {
        response: u8,
        fingerprint: u8,
        completed_at: Micros,
        expires_at: Micros,
    },
    Refused(Refusal),
}

/// A key's row as the contract sees it; it is live while `t < expires_at`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Row {
    fingerprint: u8,
    token: u64,
    attempt: u32,
    attempt_id: &'static str,
    lease_expires_at: Micros,
    checkpoint: Option<Vec<u8>>,
    /// `(response, completed_at)` once completed.
    completed: Option<(u8, Micros)>,
    retention_us: Micros,
    expires_at: Micros,
}

/// One key, through every RPC that names it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct KeySpec {
    row: Option<Row>,
    /// The highest token this key ever had: a new claim's must be above it.
    highest_token: u64,
    floor: Micros,
}

/// The feasible instants of one step: `[from, to]`, narrowed by each rule the answer implies.
struct Instants {
    from: Micros,
    to: Micros,
}

impl Instants {
    fn new(window: Window, floor: Micros) -> Self {
        Self {
            from: window.lo.max(floor - ORDER_SLACK),
            to: window.hi,
        }
    }
    fn at_least(&mut self, instant: Micros) -> &mut Self {
        self.from = self.from.max(instant);
        self
    }
    fn before(&mut self, instant: Micros) -> &mut Self {
        self.to = self.to.min(instant - 1);
        self
    }
    fn exactly(&mut self, instant: Micros) -> &mut Self {
        self.at_least(instant);
        self.to = self.to.min(instant);
        self
    }
    /// The earliest feasible instant, if any.
    fn earliest(&self) -> Option<Micros> {
        (self.from <= self.to).then_some(self.from)
    }
}

impl KeySpec {
    /// The row if it is live at every instant of `instants` that remains (narrowing them so).
    fn live<'a>(row: &'a Option<Row>, instants: &mut Instants) -> Option<&'a Row> {
        let row = row.as_ref()?;
        instants.before(row.expires_at);
        Some(row)
    }

    fn absent(&self, instants: &mut Instants) {
        if let Some(row) = &self.row {
            instants.at_least(row.expires_at);
        }
    }

    /// The guarded writes' order of refusals: absent, then a token that is not the current
    /// one, then completed.
    fn refusal_holds(&self, refusal: Refusal, token: u64, instants: &mut Instants) -> bool {
        match refusal {
            Refusal::KeyNotFound => {
                self.absent(instants);
                true
            }
            Refusal::LeaseLost => {
                Self::live(&self.row, instants).is_some_and(|row| row.token != token)
            }
            Refusal::AlreadyCompleted => Self::live(&self.row, instants)
                .is_some_and(|row| row.token == token && row.completed.is_some()),
        }
    }

    /// Checks one step and, when it is valid, applies it. `None`: not valid in this order.
    fn step(&self, op: &KeyOp, window: Window, ret: &KeyRet) -> Option<Self> {
        let mut next = self.clone();
        let mut instants = Instants::new(window, self.floor);
        let valid = match (op, ret) {
            (_, KeyRet::Refused(refusal)) => {
                let token = match op {
                    KeyOp::Complete {
                        token, response, ..
                    } => {
                        if *refusal == Refusal::AlreadyCompleted
                            && self
                                .row
                                .as_ref()
                                .and_then(|row| row.completed)
                                .is_some_and(|(held, _)| held == *response)
                        {
                            return None;
                        }
                        *token
                    }
                    KeyOp::Release { token } | KeyOp::ExtendLease { token, .. } => *token,
                    KeyOp::TryStart { .. } | KeyOp::Lookup => return None,
                };
                self.refusal_holds(*refusal, token, &mut instants)
            }
            (KeyOp::TryStart { .. }, _) => next.try_start(op, ret, &mut instants)?,
            (
                KeyOp::Complete {
                    token,
                    response,
                    retention_us,
                },
                KeyRet::Completed {
                    completed_at,
                    expires_at,
                },
            ) => {
                let row = Self::live(&self.row, &mut instants).filter(|row| row.token == *token)?;
                match row.completed {
                    Some((held, at)) => {
                        // Repeated with the same response: the same timestamps, nothing changes.
                        held == *response && at == *completed_at && row.expires_at == *expires_at
                    }
                    None => {
                        instants.exactly(*completed_at);
                        let kept = completed_at + retention_us.unwrap_or(row.retention_us);
                        let done = Row {
                            completed: Some((*response, *completed_at)),
                            checkpoint: None,
                            retention_us: retention_us.unwrap_or(row.retention_us),
                            expires_at: kept,
                            ..row.clone()
                        };
                        next.row = Some(done);
                        kept == *expires_at
                    }
                }
            }
            (KeyOp::Release { token }, KeyRet::Released) => {
                let row = Self::live(&self.row, &mut instants)?;
                next.row = None;
                row.token == *token && row.completed.is_none()
            }
            (
                KeyOp::ExtendLease {
                    token,
                    lease_us,
                    checkpoint,
                },
                KeyRet::Extended { lease_expires_at },
            ) => {
                let row = Self::live(&self.row, &mut instants)?;
                instants.exactly(lease_expires_at - lease_us);
                let extended = Row {
                    lease_expires_at: *lease_expires_at,
                    expires_at: row.expires_at.max(*lease_expires_at),
                    checkpoint: checkpoint.clone().or_else(|| row.checkpoint.clone()),
                    ..row.clone()
                };
                next.row = Some(extended);
                row.token == *token && row.completed.is_none()
            }
            (KeyOp::Lookup, KeyRet::Absent) => {
                self.absent(&mut instants);
                true
            }
            (
                KeyOp::Lookup,
                KeyRet::LookedUpInProgress {
                    lease_expires_at,
                    attempt,
                    fingerprint,
                },
            ) => Self::live(&self.row, &mut instants).is_some_and(|row| {
                row.completed.is_none()
                    && row.lease_expires_at == *lease_expires_at
                    && row.attempt == *attempt
                    && row.fingerprint == *fingerprint
            }),
            (
                KeyOp::Lookup,
                KeyRet::LookedUpCompleted {
                    response,
                    fingerprint,
                    completed_at,
                    expires_at,
                },
            ) => Self::live(&self.row, &mut instants).is_some_and(|row| {
                row.completed == Some((*response, *completed_at))
                    && row.fingerprint == *fingerprint
                    && row.expires_at == *expires_at
            }),
            _ => false,
        };
        let at = instants.earliest().filter(|_| valid)?;
        next.floor = self.floor.max(at);
        Some(next)
    }

    /// TryStart's order: absent or expired → fresh; another fingerprint → mismatch; completed →
    /// replay; the holder's attempt_id → re-entry; lease running → in_progress; else takeover.
    fn try_start(&mut self, op: &KeyOp, ret: &KeyRet, instants: &mut Instants) -> Option<bool> {
        let KeyOp::TryStart {
            fingerprint,
            attempt_id,
            lease_us,
            retention_us,
        } = op
        else {
            return None;
        };
        let claim =
            |token: u64, attempt: u32, lease_expires_at: Micros, checkpoint, expires_at| Row {
                fingerprint: *fingerprint,
                token,
                attempt,
                attempt_id,
                lease_expires_at,
                checkpoint,
                completed: None,
                retention_us: *retention_us,
                expires_at,
            };
        let current = self.row.clone();
        let valid = match ret {
            KeyRet::Started {
                token,
                lease_expires_at,
                attempt,
                checkpoint,
            } => {
                let reentered = |row: &Row| !attempt_id.is_empty() && row.attempt_id == *attempt_id;
                match current.as_ref() {
                    Some(row) if *token == row.token => {
                        // Re-entry: same token and attempt, the later of the two leases,
                        // checkpoint kept. A lease left where it was leaves the instant free
                        // (any t with t + ttl not past it); a moved one pins it.
                        if *lease_expires_at == row.lease_expires_at {
                            instants.before(row.lease_expires_at - lease_us + 1);
                        } else {
                            instants.exactly(lease_expires_at - lease_us);
                        }
                        Self::live(&current, instants);
                        self.row = Some(Row {
                            lease_expires_at: *lease_expires_at,
                            expires_at: row.expires_at.max(*lease_expires_at),
                            ..row.clone()
                        });
                        reentered(row)
                            && row.fingerprint == *fingerprint
                            && row.completed.is_none()
                            && *lease_expires_at >= row.lease_expires_at
                            && *attempt == row.attempt
                            && *checkpoint == row.checkpoint
                    }
                    _ if *attempt == 1 => {
                        // Fresh: absent, or past its retention.
                        let at = lease_expires_at - lease_us;
                        instants.exactly(at);
                        self.absent(instants);
                        let retained = at + (*lease_us).max(*retention_us);
                        self.row = Some(claim(*token, 1, *lease_expires_at, None, retained));
                        checkpoint.is_none() && self.issue(*token)
                    }
                    Some(row) => {
                        // Takeover: the lease ran out; a new token, attempt + 1, checkpoint
                        // handed over, retention the later of the old and the new one.
                        let at = lease_expires_at - lease_us;
                        instants.exactly(at).at_least(row.lease_expires_at);
                        Self::live(&current, instants);
                        let retained = at + (*lease_us).max(*retention_us);
                        self.row = Some(claim(
                            *token,
                            row.attempt + 1,
                            *lease_expires_at,
                            row.checkpoint.clone(),
                            row.expires_at.max(retained),
                        ));
                        !reentered(row)
                            && row.fingerprint == *fingerprint
                            && row.completed.is_none()
                            && *attempt == row.attempt + 1
                            && *checkpoint == row.checkpoint
                            && self.issue(*token)
                    }
                    None => false,
                }
            }
            KeyRet::InProgress {
                lease_expires_at,
                attempt,
            } => Self::live(&current, instants).is_some_and(|row| {
                instants.before(row.lease_expires_at);
                row.fingerprint == *fingerprint
                    && row.completed.is_none()
                    && (attempt_id.is_empty() || row.attempt_id != *attempt_id)
                    && row.lease_expires_at == *lease_expires_at
                    && row.attempt == *attempt
            }),
            KeyRet::Replayed {
                response,
                completed_at,
                expires_at,
            } => Self::live(&current, instants).is_some_and(|row| {
                row.fingerprint == *fingerprint
                    && row.completed == Some((*response, *completed_at))
                    && row.expires_at == *expires_at
            }),
            KeyRet::Mismatch => {
                Self::live(&current, instants).is_some_and(|row| row.fingerprint != *fingerprint)
            }
            _ => false,
        };
        Some(valid)
    }

    fn issue(&mut self, token: u64) -> bool {
        let above = token > self.highest_token;
        self.highest_token = self.highest_token.max(token);
        above
    }
}

/// An operation as the tester sees it: what was asked, and when it could have happened.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Timed<Op> {
    pub op: Op,
    pub lo: Micros,
}

/// An answer, and the latest instant it could have been decided at.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Answer<Ret> {
    pub ret: Ret,
    pub hi: Micros,
}

/// A spec's step: the next state if `ret` is a valid answer to `op` within `window`.
trait TimedStep: Sized {
    type Op;
    type Ret;
    fn timed_step(&self, op: &Self::Op, window: Window, ret: &Self::Ret) -> Option<Self>;
}

/// `SequentialSpec::is_valid_step` for a [`TimedStep`]: the window is the invocation's `lo`
/// and the answer's `hi`; an answer left out (an operation still in flight) is never valid.
fn valid_timed_step<S: TimedStep>(
    spec: &mut S,
    op: &Timed<S::Op>,
    ret: &Answer<Option<S::Ret>>,
) -> bool {
    let Some(answer) = &ret.ret else {
        return false;
    };
    let window = Window {
        lo: op.lo,
        hi: ret.hi,
    };
    match spec.timed_step(&op.op, window, answer) {
        Some(next) => {
            *spec = next;
            true
        }
        None => false,
    }
}

/// Makes `$spec`, whose inherent `step` takes an `$op` in a window and its `$ret`, a
/// [`TimedStep`] and, through [`valid_timed_step`], the checker's `SequentialSpec` of timed
/// operations.
macro_rules! timed_spec {
    ($spec:ty: $op:ty => $ret:ty) => {
        impl TimedStep for $spec {
            type Op = $op;
            type Ret = $ret;
            fn timed_step(&self, op: &$op, window: Window, ret: &$ret) -> Option<Self> {
                self.step(op, window, ret)
            }
        }

        impl SequentialSpec for $spec {
            type Op = Timed<$op>;
            type Ret = Answer<Option<$ret>>;

            /// Only for an operation left in flight, which the runner never leaves: every call
            /// answers.
            fn invoke(&mut self, _op: &Self::Op) -> Self::Ret {
                Answer { ret: None, hi: 0 }
            }

            fn is_valid_step(&mut self, op: &Self::Op, ret: &Self::Ret) -> bool {
                valid_timed_step(self, op, ret)
            }
        }
    };
}

timed_spec!(KeySpec: KeyOp => KeyRet);

/// One MarkProcessed call: its ids (indexes) in request order, and its retention.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct MarkOp {
    pub events: Vec<u8>,
    pub retention_us: Micros,
}

/// Per id in request order: `(already_processed, processed_at)`.
pub type MarkRet = Vec<(bool, Micros)>;

/// Every event, since one call marks several at once (atomically).
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct EventsSpec {
    /// Per event: `(processed_at, expires_at)` of its live-or-expired record.
    records: std::collections::BTreeMap<u8, (Micros, Micros)>,
}

impl EventsSpec {
    /// MarkProcessed judges every id at one instant `t` of its window (the statement's clock,
    /// which on PostgreSQL is read when the statement starts, not in the order rows are locked:
    /// so no floor applies here, only the window). Every new id is stamped `t`.
    fn step(&self, op: &MarkOp, window: Window, ret: &MarkRet) -> Option<Self> {
        if ret.len() != op.events.len() {
            return None;
        }
        let mut next = self.clone();
        let mut instants = Instants {
            from: window.lo,
            to: window.hi,
        };
        let mut seen_in_call = std::collections::BTreeSet::new();
        for (event, (already, processed_at)) in op.events.iter().zip(ret) {
            let first_in_call = seen_in_call.insert(*event);
            let held = next.records.get(event).copied();
            if !first_in_call {
                // A repeat within the call: processed, by the first occurrence's record.
                if !*already || held.map(|(at, _)| at) != Some(*processed_at) {
                    return None;
                }
                continue;
            }
            match (already, held) {
                (true, Some((at, expires_at))) if at == *processed_at => {
                    instants.before(expires_at);
                }
                (false, held) => {
                    if let Some((_, expires_at)) = held {
                        instants.at_least(expires_at);
                    }
                    instants.exactly(*processed_at);
                    next.records
                        .insert(*event, (*processed_at, processed_at + op.retention_us));
                }
                _ => return None,
            }
        }
        instants.earliest().map(|_| next)
    }
}

timed_spec!(EventsSpec: MarkOp => MarkRet);
