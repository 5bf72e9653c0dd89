/* claims.pml -- claims: a row of the user's table taken as a work item (PostgreSQL).
 *
 * Checks, for one row and WORKERS workers:
 *   (a) the row is completed at most once;
 *   (b) a stale completion is refused: a completion (or fail) by a claim that is no longer
 *       the row's claim writes nothing;
 *   (c) a lost claim's body never starts: a body starts only while its claim is still the
 *       row's claim at the server (not reclaimed by another worker).
 *
 * The protocol (asynclock/_core/claims.py, asynclock/backends/postgres/claims.py,
 * docs/claims.md). take() is one statement: a row that is 'ready', or 'claimed' with an
 * expired claim, becomes 'claimed' with a new token from the token source (larger than
 * every earlier claim of the row, G2). The claim is a lease of the session; its local
 * deadline passes before the row's claim_expires (G3, checked in lease.pml). `async with
 * job:` checks the claim, reading the clock, before the body starts: a lost claim raises
 * LeaseLost and is given back. complete() is one UPDATE ... WHERE id = $1 AND claim_token
 * = $2 AND status = 'claimed'; fail() and the give-back are fenced alike and make the row
 * 'ready' again.
 *
 * Model (time is abstracted away, as in idempotency.pml: lease.pml checks the timing):
 *   - each statement is one atomic step at the server;
 *   - a claim may be lost at any moment (its deadline passed, a renewal was refused, the
 *     worker froze past its ttl); only after that may the row's claim expire on the server,
 *     and then any worker may claim the row again;
 *   - a completion or fail is sent while the claim was live (or only locally lost: the row's
 *     token is the authority) and may arrive at any later time;
 *   - each worker takes the row at most once (WORKERS claims in a run; a failed row is
 *     'ready' again for the others).
 *
 * Weaker variants (the checker must find each one's violation):
 *   -DBODY_AFTER_LOSS     the body is entered without the check: a claim lost (and
 *                         reclaimed) before its block began still runs its body (c)
 *   -DUNFENCED_COMPLETE   completion checks the id and status only, not the claim token:
 *                         what the queues in docs/claims.md do (b)
 */

#define WORKERS 3

#define READY   0       /* row status */
#define CLAIMED 1
#define DONE    2

byte status = READY;
byte ctok = 0;          /* claim_token: the token of the row's newest claim */
bool expired = false;   /* the row's claim_expires has passed on the server */
byte next = 0;          /* the token source */
byte holder = 0;        /* ghost: the worker (id + 1) whose claim is the row's */

bool lost[WORKERS];     /* the worker's claim is lost locally */
byte completions = 0;   /* ghost */

/* the row's claim expires on the server: only after its holder lost it (G3) */
active proctype expiry() {
end:
  do
  :: d_step { status == CLAIMED && !expired && lost[holder - 1] -> expired = true }
  od
}

/* the row still carries claim tok */
#define LIVE(tok)  (status == CLAIMED && ctok == tok)

proctype worker(byte i) {
  byte tok;
  bool stale, written;
  /* take(): one statement */
  d_step {
    if
    :: status == READY || (status == CLAIMED && expired) ->
         next++; tok = next; status = CLAIMED; ctok = tok; expired = false; holder = i + 1
    :: else -> tok = 0                                  /* nothing claimable */
    fi };
  if
  :: tok == 0 -> goto end
  :: else
  fi;
  /* between the claim and `async with job:` (a frozen worker resuming its batch): the
     claim may be lost, the row reclaimed */
  if
  :: lost[i] = true
  :: skip
  fi;
#ifndef BODY_AFTER_LOSS
  if :: lost[i] -> goto back :: else fi;                /* LeaseLost: the body never runs */
#endif
  /* the body starts */
  d_step { assert(LIVE(tok)) };                         /* (c) */
  /* the body runs; the claim may be lost meanwhile, and the completion stays in flight
     while the row expires and is reclaimed */
  if
  :: lost[i] = true
  :: skip
  fi;
  if
  :: d_step {                                           /* complete() */
       stale = !LIVE(tok);
#ifdef UNFENCED_COMPLETE
       if :: status == CLAIMED -> status = DONE; completions++; written = true
#else
       if :: LIVE(tok) -> status = DONE; completions++; written = true
#endif
       :: else -> written = false                        /* StaleToken */
       fi;
       assert(!(stale && written));                     /* (b) */
       assert(completions <= 1);                        /* (a) */
       stale = false; written = false }
  :: d_step {                                           /* fail(): 'ready' again */
       stale = !LIVE(tok);
       if :: LIVE(tok) -> status = READY; written = true
          :: else -> written = false fi;
       assert(!(stale && written));                     /* (b) */
       stale = false; written = false }
  fi;
  goto end;
  /* the give-back of a claim lost before its block: fenced like fail() */
back:
  skip;
  d_step { if :: LIVE(tok) -> status = READY :: else fi };
end:
  skip
}

init {
  atomic { run worker(0); run worker(1); run worker(2) }
}
