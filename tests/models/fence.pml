/* fence.pml -- the fence at the resource (G8; the write half of G3).
 *
 * Checks: a write is stored only if its token is at least every token stored before it, so
 * a stale writer (paused past its lease while a newer holder wrote) never overwrites a newer
 * write. Equal tokens pass: the same holder writing again.
 *
 * Model: WRITERS writers each take a token from the lock (strictly increasing, in the order
 * the grants happen, as G2 gives them) and then write up to WRITES times. Any interleaving
 * is allowed, which includes a writer that took its token, stopped for any length of time
 * (its lease long expired, newer holders granted and writing), then writes. The resource
 * keeps `fence`, the highest token it accepted, and `stored`, the token of the last write
 * that landed. The fence check and the write are one d_step: one SQL statement
 * (INSERT ... ON CONFLICT ... DO UPDATE ... WHERE fence.token <= EXCLUDED.token), one Lua
 * compare-and-set, one conditional HTTP request.
 *
 * Weaker variants (the checker must find each one's violation):
 *   -DNONATOMIC_FENCE   read the fence, compare, then write in a second step (a SELECT, then
 *                       an UPDATE; a GET, then a PUT without a precondition)
 *   -DNO_FENCE          write without any check: a lock alone, an efficiency lock
 */

#define WRITERS 3
#define WRITES  2

byte next = 0;          /* the lock's token counter */
byte fence = 0;         /* at the resource: the highest token accepted */
byte stored = 0;        /* at the resource: the token of the last write that landed */
byte newest = 0;        /* ghost: the highest token of any write that landed */

/* the write landed: it must not be older than any write before it */
#define LANDED(t)  stored = t; assert(t >= newest); newest = t

proctype writer() {
  byte tok, seen, n;
  d_step { next++; tok = next };          /* the lease's token (G2) */
  do
  :: n < WRITES ->
       n++;
#if defined(NO_FENCE)
       d_step { LANDED(tok) }
#elif defined(NONATOMIC_FENCE)
       seen = fence;                      /* SELECT token FROM fence */
       if
       :: tok >= seen -> d_step { fence = tok; LANDED(tok) }   /* UPDATE ... */
       :: else                            /* StaleToken */
       fi;
       seen = 0
#else
       d_step {
         if
         :: tok >= fence -> fence = tok; LANDED(tok)
         :: else                          /* StaleToken: nothing written */
         fi }
#endif
  :: n == WRITES -> break
  od
}

init {
  atomic { run writer(); run writer(); run writer() }
}
