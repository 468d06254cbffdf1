/* The recovery protocol of DESIGN §6 and §9 for one submitted request, model-checked by spin.

   What a step is: every database transaction is one atomic block (the lease row lock serializes
   the transactions of a run); the sink's check-and-write (publish) and check-and-fence (inspect)
   are one atomic step each. Time passing is the Expirer, which may expire the current lease at
   any moment; a crash is a process that stops at any step; a pause is any interleaving. The mode
   of the request (atomic or forward_recovery) is chosen nondeterministically in init, so both
   modes are explored in one search.

   Run slots: the correct protocol creates exactly one run for the idempotency key (slot 0). Slot 1
   exists only so that a model without the replay lookup can create the duplicate run it would
   create in the code; its publication key differs (the key is derived from the run id). In the
   partition configuration (below) slot 1 is the run of another key of the same partition.

   The target (forward mode) is chosen nondeterministically at record time: valid, refused by the
   provider's preflight, or refused only by publish (before the sink is touched). The sink location
   may be moved away or unmounted at any moment after a publication, and come back (Mount).

   Partitions (issue 27): compiled with -DPARTITIONS (spin -DPARTITIONS -a), the same protocol runs in
   a second configuration: both run slots are runs of ONE partition of a replace_partition target,
   each under its own idempotency key, in forward mode with a valid target, with two workers, the
   sweeper (which closes a running lease at any moment), the reconciler and one automatic attempt
   per run (see init). The pre-dispatch commit takes the partition's next token; the sink keeps the
   highest token applied and refuses a lower one (superseded: a conclusive Rejected); a resume
   publishes with the token its run's authorization recorded. Without -DPARTITIONS none of this is
   compiled (partitioned is false) and the searches are the ones they were before.

   Checked in every reachable state (Monitor): invariants 4, 6, 7, 8, 9, 11, 14 of DESIGN §7, the
   preflight and honest-absence rules and the partition rules (see docs/model.md for the list), plus
   the LTL property no_retry_after_unknown (inv 8).
   model/check runs it and the mutants. Change the protocol and this model together. */

#define NR 2              /* run slots (see above) */
#ifdef PARTITIONS
#define MAX_ATTEMPTS 1    /* the partition configuration: one automatic attempt per run (see init) */
#else
#define MAX_ATTEMPTS 3    /* dataflow_runs.max_attempts: automatic attempts of a run */
#endif
#define MAXA (MAX_ATTEMPTS + 3)   /* bound on attempt numbers: automatic ones, reconcile, resume, reconcile */
#define NA (MAXA + 1)     /* attempts 0..MAXA per run slot */

mtype = { NONE, QUEUED, RUNNING, SUCCEEDED, UNKNOWN, REC_ABSENT, FAILED, CANCELLED };  /* dataflow_runs.status */
mtype = { ATOMIC, FORWARD };                                               /* dataflow_runs.mode */
mtype = { PUBLISHED, ALREADY, FENCED, REJECTED, REFUSED, INCONCLUSIVE };  /* publish answers */
mtype = { PRESENT, ABSENT, UNDECIDED };                                    /* inspect answers */
mtype = { VALID, KNOWN_BAD, LATE_BAD };                                    /* the request's target */

mtype req_mode;                /* the mode of the submitted request (its definition has a target or not) */
/* the target, fixed at record time. KNOWN_BAD: the provider's preflight refuses it (a location
   outside its root, a secret that does not resolve, a table name that does not parse). LATE_BAD:
   only publish refuses it, with an InputError before touching the sink (a provider without
   preflight, or a target changed after preflight: a folder swapped for a symlink out of the root). */
mtype target;
/* the sink location is missing (moved away, unmounted). prepare created it before dispatch could be
   authorized, so missing means unseen, never "nothing published". */
bool loc_missing = false;
/* another, empty location was created where the missing one was registered (by another run's prepare).
   The protocol never does it: a registered location that is missing fails the new run before dispatch
   (forward.check_location); only the mutant prepare-recreates-registered-location sets it. */
bool recreated = false;

/* dataflow_runs, unique (tenant, idempotency_key) */
byte key_run = 0;              /* run slot + 1 registered for the client's key; 0: none yet */
byte nruns = 0;                /* runs created for the key */
mtype status[NR] = NONE;
mtype mode[NR];

/* leases: one row per run; attempt only grows and is the fencing token */
byte attempt[NR];
bool lease_valid[NR];          /* attempt[r] holds the lease and expires_at > db_now() */

/* ledger_entries: dispatch.authorized and attempt.recovered per attempt; index r * NA + a */
bool authorized[NR * NA];
bool recovered[NR * NA];
bool ever_authorized[NR];      /* any dispatch.authorized in the run's history (what cancel reads) */

/* run_results and checkpoints */
byte results[NR];              /* stored result rows of the run */
bool checkpoint[NR];           /* verified checkpoint written */

/* the sink: one publication key per run */
byte sink_pubs[NR];            /* publications of the key */
byte sink_pub_token[NR];       /* fencing token of the publication */
byte sink_fence[NR];           /* fence recorded for the key by an inspection */

/* The partition (issue 27): both run slots publish into one partition. PARTITIONS configuration
   only: without it partitioned is false and the partition's variables, steps and checks are not
   compiled at all, so the first configuration's search is exactly what it was before. */
#ifdef PARTITIONS
#define partitioned true
byte part_counter = 0;         /* partition_tokens.token: the last token taken for the partition */
byte part_token[NR];           /* the token the run's dispatch.authorized recorded; 0: none yet */
byte sink_part_token = 0;      /* the highest partition token the sink applied */
byte sink_part_rows = 0;       /* the runs whose rows the partition holds, one bit per run slot */
byte auth_count = 0;           /* history: dispatch authorizations of the partition so far */
byte auth_seq[NR];             /* history: the order of the run's (first) dispatch authorization; 0: none */
byte applied_max = 0;          /* history: the highest auth_seq among the runs whose rows the sink applied */
#else
#define partitioned false
#endif

/* history variables, for the checks only */
bool ever_succeeded[NR];
bool ever_failed[NR];
bool ever_cancelled[NR];
bool unknown_seen[NR];         /* outcome_unknown was recorded at some point */
bool unknown_open[NR];         /* outcome_unknown recorded and no conclusive inspection since */
bool ever_absent[NR];
byte absent_fence[NR];         /* fence of the inspection that declared the key absent */
byte absent_pubs[NR];          /* publications at the sink when it was declared absent */

#define AI(r, a)            ((r) * NA + (a))
/* core/fencing.py fenced(...): the lease row is locked (the atomic block) and the write goes on
   only while the attempt is current and its lease unexpired; otherwise StaleAttempt, rollback. */
#define fenced_ok(r, tok)   (attempt[r] == tok && lease_valid[r])
/* the sink refuses a publish whose token is below the key's fence */
#define below_fence(r, tok) (sink_fence[r] > tok)
#define leased(r)           (lease_valid[r])
#define claimable(r)        (status[r] == QUEUED && !lease_valid[r] && attempt[r] < MAXA)
/* expired, or live with its holder gone (PostgreSQL, core/holders.py: the holder lock is free, because
   its process died or, rarely, its lock session ended while it lives on). The model lets the sweeper
   take any live lease at any moment: a superset of what the holder lock allows, safe because the
   sweep closes the lease first, exactly as for an expiry. */
#define sweepable(r)        (status[r] == RUNNING)
#define reconcilable(r)     (status[r] == UNKNOWN && !lease_valid[r] && attempt[r] < MAXA)
#define resumable(r)        (status[r] == REC_ABSENT && !lease_valid[r] && attempt[r] < MAXA)
#define pick_run(cond)      if :: cond(0) -> r = 0 :: cond(1) -> r = 1 fi

/* a write by attempt a after its attempt.recovered would contradict the ledger (inv 9) */
#define closed_attempt_writes_nothing(r, tok)  assert(!recovered[AI(r, tok)])

#ifdef PARTITIONS
/* forward.authorize_dispatch: partition_tokens.take, in the pre-dispatch commit, recorded in
   dispatch.authorized (auth_seq is the history of the same order, for the checks) */
#define take_partition_token(r) \
  part_counter++; part_token[r] = part_counter; auth_count++; auth_seq[r] = auth_count
/* the sink refuses a partition token below the highest it applied (contract.SUPERSEDED) */
#define superseded(r)       (sink_part_token > part_token[r])
/* the partition's one transaction: its rows replaced by the run's, its token raised (with the key's record) */
#define replace_partition(r) \
  sink_part_token = part_token[r]; sink_part_rows = (1 << (r)); \
  if :: applied_max < auth_seq[r] -> applied_max = auth_seq[r] :: else -> skip fi
#else
/* no partition: no steps at all (an inert step would still lengthen the breadth-first mutant searches) */
#define take_partition_token(r)
#define superseded(r)       false
#define replace_partition(r)
#endif

#define record_succeeded(r) status[r] = SUCCEEDED; ever_succeeded[r] = true; checkpoint[r] = true
#define record_failed(r)    status[r] = FAILED; ever_failed[r] = true
#define record_cancelled(r) status[r] = CANCELLED; ever_cancelled[r] = true
#define record_unknown(r)   status[r] = UNKNOWN; unknown_seen[r] = true; unknown_open[r] = true

/* datasources provider publish(key, token, ...): check and write in one atomic step at the sink */
inline publish(r, tok, res) {
  atomic {
    closed_attempt_writes_nothing(r, tok);     /* inv 9: an attempt proven absent never reaches the sink */
    if
    :: target != VALID -> res = REFUSED        /* InputError, raised before the sink is touched */
    :: else ->
         if
         :: loc_missing -> res = INCONCLUSIVE  /* a missing location is not re-created: nothing written, nothing proven */
         :: !loc_missing && sink_pubs[r] > 0 -> res = ALREADY
         :: !loc_missing && sink_pubs[r] == 0 && below_fence(r, tok) -> res = FENCED
         :: !loc_missing && sink_pubs[r] == 0 && !below_fence(r, tok) && superseded(r) -> res = REJECTED   /* superseded: nothing written */
         :: !loc_missing && sink_pubs[r] == 0 && !below_fence(r, tok) && !superseded(r) ->
              sink_pubs[r]++; sink_pub_token[r] = tok; res = PUBLISHED; replace_partition(r)
         :: !loc_missing && sink_pubs[r] == 0 && !below_fence(r, tok) -> res = REJECTED   /* the sink proves nothing was created */
         fi
    fi
  }
}

/* datasources provider inspect(key, fence=m): an absent key is fenced at m atomically with the check */
inline inspect(r, m, found) {
  atomic {
    if
    :: loc_missing -> found = UNDECIDED        /* honest absence: a missing location is never Absent */
    :: target != VALID -> found = UNDECIDED    /* the target does not resolve: the inspection fails, decides nothing */
    :: !loc_missing && recreated && target == VALID -> found = ABSENT   /* a new, empty location holds nothing */
    :: !loc_missing && !recreated && target == VALID && sink_pubs[r] > 0 -> found = PRESENT
    :: !loc_missing && !recreated && target == VALID && sink_pubs[r] == 0 ->
         found = ABSENT; if :: sink_fence[r] < m -> sink_fence[r] = m :: else -> skip fi
    fi
  }
}

/* dataflow/protocol/service.py: the fenced transaction after the provider answered (or did not) */
inline terminal_after_publish(r, tok, res, received) {
  atomic {
    if
    :: fenced_ok(r, tok) -> /* fenced terminal commit */
         closed_attempt_writes_nothing(r, tok);        /* inv 9 */
         if
         :: received && (res == PUBLISHED || res == ALREADY) -> record_succeeded(r); lease_valid[r] = false
         :: received && (res == REJECTED || res == REFUSED) -> record_failed(r); lease_valid[r] = false
         :: received && res == FENCED -> skip            /* stale: records nothing */
         :: !received || res == INCONCLUSIVE ->
              assert(res != REFUSED);   /* outcome_unknown only when the sink may have been touched */
              record_unknown(r); lease_valid[r] = false
         fi
    :: else -> skip                                      /* StaleAttempt */
    fi
  }
}

/* core/leases.py heartbeat: extends expires_at, fenced like any write; a failed heartbeat makes the
   worker abandon the attempt. With expiry at any moment, a successful heartbeat changes nothing in
   the model; what matters is that it never revives an expired or superseded lease. */
#define heartbeat(r, my) \
  if \
  :: skip \
  :: atomic { if :: fenced_ok(r, my) -> lease_valid[r] = true :: else -> goto stale fi } \
  fi

/* a finished or crashed worker keeps no memory of its attempt: without this, stale values of
   local variables would multiply the states without adding behaviour */
#define forget_locals()  atomic { r = 0; my = 0; res = 0; received = false }

#define crash_point  if :: skip :: goto crashed fi

/* dataflow/protocol/service.py submit: one transaction; the replay lookup on (tenant, idempotency_key) */
/* A replay with the same request_hash returns the existing run, one with a different request_hash
   is a Conflict; both write nothing, so the model does not tell them apart. */
inline submit() {
  atomic {
    if
    :: key_run > 0 -> /* replay lookup */
         skip
    :: else ->
         status[nruns] = QUEUED; mode[nruns] = req_mode;
         key_run = nruns + 1; nruns++
    fi
  }
}

/* the client that replays the key, at any moment after the first submission */
proctype Replayer() { submit() }

proctype Worker() {
  byte r; byte my; mtype res; bool received;
  do
  :: atomic {                        /* core/leases.py acquire: the claim of a queued run */
       pick_run(claimable);
       assert(!authorized[AI(r, attempt[r])]);   /* never an automatic retry after dispatch authorization (inv 8) */
       assert(attempt[r] < MAX_ATTEMPTS);        /* automatic attempts stay within max_attempts */
       attempt[r]++; my = attempt[r]; lease_valid[r] = true; status[r] = RUNNING }
     crash_point;                    /* crash during execution */
     heartbeat(r, my);
     if
     :: mode[r] == ATOMIC ->
          atomic {                   /* the one fenced transaction of atomic mode */
            if
            :: fenced_ok(r, my) -> /* fenced atomic commit */
                 closed_attempt_writes_nothing(r, my);   /* inv 9 */
                 results[r]++; record_succeeded(r); lease_valid[r] = false
            :: else -> skip
            fi
          }
     :: mode[r] == FORWARD ->
          atomic {                   /* preflight, then the pre-dispatch fenced commit: result stored, dispatch.authorized */
            if
            :: target == KNOWN_BAD -> /* preflight */
                 if                  /* service.fail_before_dispatch: fenced, failed / no_external_output */
                 :: fenced_ok(r, my) -> closed_attempt_writes_nothing(r, my); record_failed(r); lease_valid[r] = false
                 :: else -> skip     /* StaleAttempt: records nothing */
                 fi;
                 goto stale
            :: else -> skip          /* preflight passes; prepare creates the sink location */
            fi;
            if
            :: fenced_ok(r, my) -> /* pre-dispatch */
                 closed_attempt_writes_nothing(r, my);   /* inv 9 */
                 results[r]++; authorized[AI(r, my)] = true; ever_authorized[r] = true;
                 take_partition_token(r)
            :: else -> goto stale
            fi
          }
          crash_point;               /* crash after authorization */
          heartbeat(r, my);
          publish(r, my, res);
          /* the response is lost (never an InputError's: it is raised before the sink is called), or a crash */
          if :: received = true :: received = (res == REFUSED) :: goto crashed fi;
          terminal_after_publish(r, my, res, received)
     fi;
stale:
     forget_locals()
  od;
crashed:
  forget_locals()
}

/* dataflow/protocol/sweeper.py: one decision per expired lease, or per live lease whose holder is gone, in one
   transaction that closes the lease (close_expired / close_dead_holder) */
proctype Sweeper() {
  byte r;
  do
  :: atomic {
       pick_run(sweepable);
       lease_valid[r] = false;   /* the lease is closed: its attempt is fenced off */
       if
       :: authorized[AI(r, attempt[r])] -> record_unknown(r)
       :: else ->
            recovered[AI(r, attempt[r])] = true;
            if
            :: attempt[r] < MAX_ATTEMPTS -> status[r] = QUEUED   /* retried under the next attempt */
            :: else -> record_failed(r)                          /* max_attempts exhausted: no external output */
            fi
       fi }
  od
}

/* dataflow/protocol/cancel.py: an operator cancels the run once, at any moment. A queued run is cancelled
   with its row locked (a claim either took it first or skips it). A running one: the lease row is
   locked and closed first, which fences the attempt off (its later writes are StaleAttempt), then
   the ledger is read: after any dispatch authorization a publication may exist, so the cancel is
   refused (rolled back, the lease stays) and reconcile settles the run instead. Slot 0 only: slot 1
   exists only in the mutants without the replay lookup. */
proctype Canceller() {
  byte r = 0;
  atomic {
    status[r] == QUEUED || status[r] == RUNNING;
    if
    :: status[r] == QUEUED -> record_cancelled(r)
    :: status[r] == RUNNING && ever_authorized[r] -> skip   /* refused: reconcile instead */
    :: status[r] == RUNNING && !ever_authorized[r] -> lease_valid[r] = false; record_cancelled(r)
    fi
  }
}

/* the sink location is moved away or unmounted at any moment after a publication, and comes back */
proctype Mount() {
  do
  :: atomic { !loc_missing && sink_pubs[0] + sink_pubs[1] > 0 -> loc_missing = true }
  :: atomic { loc_missing -> loc_missing = false }
  od
}

/* another run of the same datasource prepares its location while the registered one is missing: it
   fails before dispatch and creates nothing (a new, empty location would let a reconcile prove this
   key absent while its publication is in the missing one) */
proctype OtherRun() {
  do
  :: atomic { loc_missing && !recreated -> skip }
  od
}

proctype Expirer() {
  byte r;
  do
  :: atomic { pick_run(leased) -> lease_valid[r] = false }
  od
}

/* dataflow/protocol/reconcile.py, driven by an operator; it may crash, get Undecided, or lose its lease,
   and the operator may run it again. */
proctype Reconciler() {
  byte r; byte m; mtype found; mtype res; bool received;
  do
  :: atomic { pick_run(reconcilable); attempt[r]++; m = attempt[r]; lease_valid[r] = true }
     if :: skip :: goto next fi;                  /* crash, or inspect answers Undecided: nothing changes */
     inspect(r, m, found);
     if :: found != UNDECIDED :: goto next fi;    /* Undecided changes nothing; or a crash before the commit */
     atomic {
       if
       :: fenced_ok(r, m) ->
            if
            :: found == PRESENT -> record_succeeded(r)      /* reconciled_present */
            :: found == ABSENT -> status[r] = REC_ABSENT; ever_absent[r] = true; absent_fence[r] = m; absent_pubs[r] = sink_pubs[r]
            fi;
            unknown_open[r] = false; lease_valid[r] = false
       :: else -> skip
       fi
     }
  :: atomic {                                     /* resume: the stored bytes, the same key, a new attempt */
       pick_run(resumable); attempt[r]++; m = attempt[r]; lease_valid[r] = true; status[r] = RUNNING;
       /* the original dispatch.authorized, copied: the same partition token (part_token[r] unchanged) */
       authorized[AI(r, m)] = true; ever_authorized[r] = true }
     publish(r, m, res);
     if :: received = true :: received = (res == REFUSED) :: goto next fi;
     terminal_after_publish(r, m, res, received)
next:
     atomic { r = 0; m = 0; found = 0; res = 0; received = false }
  od
}

/* The invariants, checked by the Monitor in every reachable state, for both run slots. Where a
   broken guard violates several in the same state, spin reports the first in the Monitor's order. */
#define inv14(r)  (!ever_absent[r] || sink_pubs[r] == 0 || sink_pub_token[r] >= absent_fence[r])
#define absent_was_true(r) (!ever_absent[r] || absent_pubs[r] == 0)
#define inv6(r)   (sink_pubs[r] <= 1)
#define final(r)  ((!ever_succeeded[r] || status[r] == SUCCEEDED) && (!ever_failed[r] || status[r] == FAILED) \
                   && (!ever_cancelled[r] || status[r] == CANCELLED))
/* cancelled / no_external_output: no result stored, nothing at the sink */
#define cancelled_nothing(r) (status[r] != CANCELLED || (results[r] == 0 && sink_pubs[r] == 0))
#define inv8(r)   (!unknown_open[r] || status[r] == UNKNOWN)
#define inv7(r)   (status[r] != SUCCEEDED || mode[r] == ATOMIC || sink_pubs[r] == 1)
#define inv4(r)   (mode[r] != ATOMIC || (sink_pubs[r] == 0 && (status[r] == SUCCEEDED) == (results[r] == 1)))
#define one_result(r) (results[r] <= 1)
#define ckpt(r)   ((status[r] == SUCCEEDED) == checkpoint[r])
/* failed / no_external_output, and reconciled_absent (status failed in the code): nothing at the
   sink, even where the location is missing (sink_pubs counts the publications it holds) */
#define failed_nothing_published(r) ((status[r] != FAILED && status[r] != REC_ABSENT) || sink_pubs[r] == 0)
#define preflight_refuses(r) (target != KNOWN_BAD || results[r] == 0)
#define refused_publishes_nothing(r) (target == VALID || sink_pubs[r] == 0)
/* the partition (issue 27): holds(r) — the partition holds run r's rows and no other run's */
#define holds(r)            (sink_part_rows == (1 << (r)))
/* once published, the partition holds exactly one run's rows (a replacement never appends) */
#define part_one_run        (applied_max == 0 || holds(0) || holds(1))
/* never backwards: it holds the rows of the run authorized last among those the sink applied */
#define part_latest         (sink_part_rows == 0 || (holds(0) && auth_seq[0] == applied_max) \
                             || (holds(1) && auth_seq[1] == applied_max))
/* a run recorded succeeded is the one whose rows the partition holds, or one authorized later replaced them */
#define part_success(r)     (status[r] != SUCCEEDED || holds(r) \
                             || (holds(1 - (r)) && auth_seq[1 - (r)] > auth_seq[r]))
/* the rows the partition holds are the publication of their run's key (one transaction) */
#define part_recorded(r)    (!holds(r) || sink_pubs[r] == 1)

active proctype Monitor() {
  do
  :: assert(inv14(0) && inv14(1))                       /* inv 14: a conclusive absence stays true */
  :: assert(absent_was_true(0) && absent_was_true(1))   /* absence is declared only when true */
  :: assert(inv6(0) && inv6(1))                         /* inv 6: at most one publication per run */
  :: assert(partitioned || sink_pubs[0] + sink_pubs[1] <= 1)   /* inv 6 + 11: one publication per idempotency key */
  :: assert(req_mode != ATOMIC || results[0] + results[1] <= 1)   /* inv 11: one atomic result per key */
  :: assert(final(0) && final(1))                       /* succeeded and failed are final */
  :: assert(inv8(0) && inv8(1))                         /* inv 8: unknown until a conclusive inspection */
  :: assert(inv7(0) && inv7(1))                         /* inv 7: success only with the publication */
  :: assert(one_result(0) && one_result(1))             /* one stored result per run (one pre-dispatch) */
  :: assert(inv4(0) && inv4(1))                         /* inv 4: atomic result and success together */
  :: assert(ckpt(0) && ckpt(1))                         /* success and verified checkpoint together */
  :: assert(failed_nothing_published(0) && failed_nothing_published(1))   /* Rejected is conclusive */
  :: assert(preflight_refuses(0) && preflight_refuses(1))   /* a target preflight refuses is never authorized */
  :: assert(refused_publishes_nothing(0) && refused_publishes_nothing(1))   /* a refused target is never published */
  :: assert(cancelled_nothing(0) && cancelled_nothing(1))   /* a cancelled run stored and published nothing */
#ifdef PARTITIONS
  :: assert(part_one_run)                               /* partition: exactly one run's rows once published */
  :: assert(part_latest)                                /* partition: never backwards (the later authorized run wins) */
  :: assert(part_success(0) && part_success(1))         /* partition: a succeeded run's rows, or replaced by a later one */
  :: assert(part_recorded(0) && part_recorded(1))       /* partition: its rows are its run's publication */
#endif
  od
}

/* inv 8: once unknown, the run is never queued for an automatic retry */
ltl no_retry_after_unknown { [] (unknown_seen[0] -> [] (status[0] != QUEUED)) }

init {
#ifdef PARTITIONS
  atomic {                          /* two runs of one partition, two keys: a schedule tick and a re-run */
    req_mode = FORWARD; target = VALID;
    submit();                       /* the first key: run slot 0 */
    status[1] = QUEUED; mode[1] = FORWARD; nruns = 2;   /* another key of the same partition: run slot 1 */
    run Worker(); run Worker();
    run Sweeper(); run Reconciler()   /* no Expirer: the sweeper closes a running lease at any moment */
  }
#else
  atomic {
    if :: req_mode = ATOMIC :: req_mode = FORWARD fi;
    if                              /* the target, fixed at record time (an atomic run has none) */
    :: req_mode == ATOMIC -> target = VALID
    :: req_mode == FORWARD -> target = VALID
    :: req_mode == FORWARD -> target = KNOWN_BAD
    :: req_mode == FORWARD -> target = LATE_BAD
    fi;
    submit();                       /* the first submission of the key */
    run Replayer();
    run Worker(); run Worker(); run Worker();
    run Sweeper(); run Expirer(); run Mount(); run OtherRun(); run Reconciler(); run Canceller()
  }
#endif
}
