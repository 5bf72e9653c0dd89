/* lease.pml -- the lease core: acquire, renewal, local deadline, loss, release, restart.
 *
 * Checks G1 (never two holders' bodies running at once), G3 (a holder's local deadline
 * passes before the server can grant the name to anyone else) and G2 (tokens strictly
 * increase across grants, across a server restart that lost every key and the counter).
 *
 * Model (one name, two clients, one server; each event is one indivisible d_step, as the
 * server's Lua script or SQL statement is):
 *   - time is integer ticks of the server clock; every timer below counts ticks *left*, so
 *     states that differ only by when they happened are one state. A lease lasts TTL ticks
 *     on the server: granted or extended at server tick r, the name is free from r + TTL;
 *   - a client reads t_send before it sends acquire/extend and sets its local deadline
 *     t_send + TTL - DRIFT - MARGIN on its own clock, which may run slow by up to DRIFT ticks
 *     per TTL: in server ticks the deadline falls anywhere in
 *     [t_send + BUDGET, t_send + BUDGET + DRIFT] (the checker picks, per grant and renewal);
 *   - requests and replies may be delayed any number of ticks or lost; one request in flight
 *     per client; renewals may be sent at any moment of a hold (the heartbeat), any number;
 *   - a client may be paused (SIGSTOP) once, for any number of ticks; a paused client does
 *     nothing; on resume, an overdue deadline cancels the body before it runs again;
 *   - a body runs while its client holds and is not paused; the tick that reaches the local
 *     deadline cancels it (G4: loss cancels the holder);
 *   - the server may restart once and lose every key and its counter; it is down for the rest
 *     of that tick, then refuses grants for GRACE ticks (the longest ttl ever granted); a
 *     missing counter is seeded from the clock: now * SEED, SEED > grants per tick (Redis
 *     seeds from TIME in ms * 1000: fewer than 1,000 grants per ms);
 *   - at most MAXG grants in a run. The absolute clock `now` (only the seed reads it) stops
 *     counting at HORIZON while ticks go on, and the restart happens before HORIZON, so every
 *     order of first seed, restart and reseed is covered and the state space stays finite.
 *
 * Weaker variants (the checker must find each one's violation):
 *   -DNO_LOCAL_DEADLINE   the holder runs until it is told it lost (an extend refused)
 *   -DNO_DRIFT_ALLOWANCE  deadline = t_send + TTL - MARGIN, no drift term
 *   -DSHORT_GRACE         the restart grace is one tick shorter than the longest ttl
 *   -DNO_SEED             a lost counter restarts from zero instead of the clock (G2)
 */

#define TTL      4
#define DRIFT    1      /* the holder's clock may lose up to 1 tick per TTL */
#define MARGIN   0      /* a few ms: less than a tick, so 0 (no slack for the checker) */
#define BUDGET   (TTL - DRIFT - MARGIN)
#define MAXAGE   (TTL + DRIFT)   /* a reply this old finds its deadline already past */
#define HORIZON  4
#define MAXG     3
#define SEED     4      /* > MAXG */
#define NEVER    255

#ifdef SHORT_GRACE
#define GRACE    (TTL - 1)
#else
#define GRACE    TTL
#endif

#define IDLE   0        /* client states */
#define WAIT   1        /* acquire sent, no answer yet */
#define HOLD   2

#define NONE   0        /* message kinds */
#define ACQ    1
#define EXT    2
#define REL    3
#define OK     4
#define BUSY   5
#define REFUSED 6

byte now = 0;           /* absolute, read only by the counter's seed; stops at HORIZON */

/* server */
byte owner = 0;         /* client id + 1; 0 = free */
byte otok = 0;          /* the owner's grant number */
byte left = 0;          /* ticks until the name is free */
byte ctr = 0;           /* token counter; 0 = missing (fresh or lost) */
bool down = false;      /* restarting: handles nothing until the next tick */
bool restarted = false;
byte grace = 0;         /* ticks of restart grace left: no grant meanwhile */

/* clients */
byte st[2];
byte tok[2];            /* grant number of the hold */
byte dl[2];             /* ticks until the local deadline */
bool paused[2];
bool pause_used[2];
byte req[2];            /* request in flight */
byte rep[2];            /* reply in flight */
byte age[2];            /* ticks since the t_send of the request in flight */
byte rep_tok[2];        /* the grant number an OK to an acquire carries */

/* ghosts */
byte grants = 0;
byte maxtok = 0;        /* the highest token ever granted; survives the restart */

#define RUNS(i) (st[i] == HOLD && !paused[i])
#define G1      assert(!(RUNS(0) && RUNS(1)))

/* ticks left until the local deadline of a request sent `a` ticks ago, read on a clock
   that lost s ticks meanwhile (0 = already past) */
#ifdef NO_LOCAL_DEADLINE
#define DEADLINE(a, s, d)  d = NEVER
#else
#ifdef NO_DRIFT_ALLOWANCE
#define LOCAL_BUDGET  (TTL - MARGIN)
#else
#define LOCAL_BUDGET  BUDGET
#endif
#define DEADLINE(a, s, d)  if :: LOCAL_BUDGET + s > a -> d = LOCAL_BUDGET + s - a :: else -> d = 0 fi
#endif

inline lose(i) {
  st[i] = IDLE; tok[i] = 0; dl[i] = 0
}

inline tick_client(i) {
  if :: req[i] != NONE || rep[i] != NONE -> if :: age[i] < MAXAGE -> age[i]++ :: else fi
     :: else -> age[i] = 0 fi;
  if :: dl[i] > 0 && dl[i] != NEVER -> dl[i]-- :: else fi;
  if :: st[i] == HOLD && !paused[i] && dl[i] == 0 -> lose(i) :: else fi
}

/* the client reads a reply; s = how many ticks its clock lost since t_send (0..DRIFT) */
inline read_reply(i, s) {
  d_step { rep[i] != NONE && !paused[i] ->
       if
       :: rep[i] == OK && st[i] == WAIT ->
            st[i] = HOLD; tok[i] = rep_tok[i]; DEADLINE(age[i], s, dl[i]);
            if :: dl[i] == 0 -> lose(i) :: else fi
       :: rep[i] == OK && st[i] == HOLD ->
            DEADLINE(age[i], s, d);
            if :: d > dl[i] -> dl[i] = d :: else fi;
            d = 0
       :: rep[i] == REFUSED && st[i] == HOLD -> lose(i)
       :: rep[i] == BUSY && st[i] == WAIT -> st[i] = IDLE
       :: else             /* the answer to a hold already lost */
       fi;
       rep[i] = NONE; rep_tok[i] = 0; age[i] = 0; G1 }
}

proctype client(byte i) {
  byte d;
end:
  do
     /* acquire: t_send is read before sending */
  :: d_step { st[i] == IDLE && req[i] == NONE && rep[i] == NONE && grants < MAXG ->
       st[i] = WAIT; req[i] = ACQ; age[i] = 0 }
     /* renew: the heartbeat sends one extend at a time */
  :: d_step { st[i] == HOLD && !paused[i] && req[i] == NONE && rep[i] == NONE ->
       req[i] = EXT; age[i] = 0 }
     /* release by token: the body has ended; the answer is not needed */
  :: d_step { st[i] == HOLD && !paused[i] && req[i] == NONE && rep[i] == NONE ->
       req[i] = REL; rep_tok[i] = tok[i]; lose(i) }
     /* an acquire without an answer times out (its request or reply was lost) */
  :: d_step { st[i] == WAIT && !paused[i] && req[i] == NONE && rep[i] == NONE -> st[i] = IDLE }
     /* the network loses a request or a reply */
  :: d_step { req[i] != NONE -> req[i] = NONE; rep_tok[i] = 0; age[i] = 0 }
  :: d_step { rep[i] != NONE -> rep[i] = NONE; rep_tok[i] = 0; age[i] = 0 }
     /* the client reads a reply; its clock ran at full speed, or slow by DRIFT */
  :: read_reply(i, 0)
  :: read_reply(i, DRIFT)
     /* SIGSTOP, once */
  :: d_step { !paused[i] && !pause_used[i] && st[i] != IDLE -> paused[i] = true; pause_used[i] = true }
     /* SIGCONT: an overdue deadline cancels the body before it runs */
  :: d_step { paused[i] ->
       paused[i] = false;
       if :: st[i] == HOLD && dl[i] == 0 -> lose(i) :: else fi;
       G1 }
     /* the server runs the request: one script / statement */
  :: d_step { req[i] != NONE && !down ->
       if
       :: req[i] == ACQ ->
            if
            :: (owner == 0 || left == 0) && grace == 0 ->
                 if :: ctr == 0 ->
#ifdef NO_SEED
                      skip
#else
                      ctr = now * SEED
#endif
                 :: else fi;
                 ctr++;
                 assert(ctr > maxtok);                           /* G2 */
                 assert(!(st[1-i] == HOLD && dl[1-i] > 0));      /* G3 */
                 maxtok = ctr; grants++;
                 owner = i + 1; otok = grants; left = TTL;
                 rep[i] = OK; rep_tok[i] = grants
            :: else -> rep[i] = BUSY
            fi
       :: req[i] == EXT ->
            if
            :: owner == i + 1 && otok == tok[i] && left > 0 -> left = TTL; rep[i] = OK
            :: else -> rep[i] = REFUSED
            fi
       :: req[i] == REL ->
            if :: owner == i + 1 && otok == rep_tok[i] -> owner = 0; otok = 0; left = 0 :: else fi;
            rep_tok[i] = 0; age[i] = 0
       fi;
       req[i] = NONE }
  od
}

init {
  atomic { run client(0); run client(1) };
end:
  do
     /* the server restarts and loses every key and its counter: down for the rest of this
        tick, no grant for GRACE ticks from this one */
  :: d_step { !restarted && now < HORIZON ->
       restarted = true; down = true; owner = 0; otok = 0; left = 0; ctr = 0;
       req[0] = NONE; req[1] = NONE; grace = GRACE }
     /* a tick: a running holder whose deadline has come is cancelled in the same step */
  :: d_step {
       if :: now < HORIZON -> now++ :: else fi;
       down = false;
       if :: left > 0 -> left-- :: else fi;
       if :: grace > 0 -> grace-- :: else fi;
       tick_client(0); tick_client(1);
       G1 }
  od
}
