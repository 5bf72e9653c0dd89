/* idempotency.pml -- idempotency keys: the record of one operation, kept beside its lease.
 *
 * Checks, for one key and CALLERS calls of it:
 *   (a) at most one result is stored, and it is never replaced (a late writer is refused);
 *   (b) once a result is stored, the operation never starts again (later calls replay it);
 *   (c) a body starts only while its hold is still the live one at the server (a hold lost
 *       before the body was entered never runs it).
 *
 * Model (time is abstracted away: lease.pml checks the timing):
 *   - a call is one atomic step at the server (Lua / one SQL statement / etcd Txn): a `done`
 *     record replays; a key held by a live lease answers InProgress; otherwise the call takes
 *     the key with a new, larger token and writes the record `running`;
 *   - a hold may be lost at any moment (its local deadline passed, its extend was refused);
 *     only after that may the server free the name (G3, checked in lease.pml), and the next
 *     call takes over the abandoned `running` record;
 *   - the body's save is a request that may be delayed without bound (sent while the hold was
 *     live, it may arrive after the hold was lost and a successor took the key); the server
 *     stores it only while the writer's lease is the live one, in the same atomic step.
 *
 * Weaker variants (the checker must find each one's violation):
 *   -DUNFENCED_SAVE     the save writes the record without checking the lease (a plain SET)
 *   -DNO_ENTRY_CHECK    the body is entered without checking that the hold is still live
 *   -DNO_RECORD_CHECK   a call takes the key without looking for a stored result
 */

#define CALLERS 3

#define NONE    0       /* record states */
#define RUNNING 1
#define DONE    2

byte owner = 0;         /* caller id + 1 of the live lease; 0 = free */
byte otok = 0;          /* its token */
byte next = 0;          /* the token counter */
byte rec = NONE;        /* the record */
byte rec_tok = 0;       /* the token of the call that wrote it */

bool lost[CALLERS];     /* the caller's hold is lost (its local deadline passed) */
byte stores = 0;        /* ghost: results stored */

/* the server frees a lost hold's name (its ttl ran out): only after the holder lost it, G3 */
active proctype expiry() {
end:
  do
  :: d_step { owner != 0 && lost[owner - 1] -> owner = 0; otok = 0 }
  od
}

proctype caller(byte i) {
  byte tok;
  /* the call: one atomic step at the server */
  d_step {
    if
#ifndef NO_RECORD_CHECK
    :: rec == DONE -> tok = 0                               /* replayed: nothing runs */
#endif
    :: else ->
         if
         :: owner == 0 -> next++; tok = next; owner = i + 1; otok = tok; rec = RUNNING; rec_tok = tok
         :: else -> tok = 0                                 /* InProgress */
         fi
    fi };
  if
  :: tok == 0 -> goto end
  :: else
  fi;
  /* between the grant and the body: the hold may be lost (and the name freed) */
  if
  :: lost[i] = true
  :: skip
  fi;
#ifndef NO_ENTRY_CHECK
  if :: lost[i] -> goto free :: else fi;
#endif
  /* the body starts */
  d_step { assert(owner == i + 1 && otok == tok);          /* (c) */
           assert(rec != DONE) }                            /* (b) */
  /* the body runs and sends its result; the hold may be lost meanwhile, and the save
     request stays in flight while the server frees the name and others call */
  if
  :: lost[i] = true
  :: skip
  fi;
  d_step {
#ifdef UNFENCED_SAVE
    rec = DONE; rec_tok = tok; stores++
#else
    if
    :: owner == i + 1 && otok == tok && rec == RUNNING && rec_tok == tok ->
         rec = DONE; stores++
    :: else                                                 /* StaleToken: nothing stored */
    fi
#endif
    ;
    assert(stores <= 1) };                                  /* (a) */
  /* release by token */
free:
  skip;
  d_step { if :: owner == i + 1 && otok == tok -> owner = 0; otok = 0 :: else fi };
end:
  skip
}

init {
  atomic { run caller(0); run caller(1); run caller(2) }
}
