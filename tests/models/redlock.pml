/* redlock.pml -- Redlock over N independent Redis nodes, with the two-phase token scheme.
 *
 * Checks, for one name, two clients and N = 3 nodes (quorum 2):
 *   G1  a client accepts a grant only while no other client holds a valid lease;
 *   G2  every grant a client accepts has a token strictly above every token accepted before
 *       (across a node restart that lost the key and the counter);
 *   G3  at the resource, no write of an earlier grant lands after a write of a later one:
 *       the fence (check and write in one step, fence.pml) refuses the write of a client
 *       whose lease expired while its write was on its way (the paused client) once its
 *       successor has written.
 *
 * The scheme (asynclock/backends/redis/redlock.py; docs/backends/redis.md, "Redlock fencing
 * tokens"). Phase 1 runs the acquire script on every node: if the key is free and the
 * node's restart grace is over, SET the key (owner, ttl) and INCR the node's counter. The
 * client waits for every node's answer or timeout; with a quorum of grants, t = the largest
 * counter returned. If they all agree the client holds t; otherwise phase 2 raises the
 * counter of each granting node that still holds the key to max(counter, t), and needs a
 * quorum of acknowledgements. A failed attempt gives back: a release on every node.
 *
 * Model. Time is abstracted as in idempotency.pml; lease.pml checks the timing against one
 * server, and this model takes its result for each node:
 *   - an attempt's local deadline (from the t_send of its phase 1) may pass at any moment:
 *     `dead`. It passes before any of the attempt's keys can expire (each key was SET after
 *     t_send and lasts the ttl; the deadline is t_send + ttl - drift - margin, lease.pml G3),
 *     so a node drops an attempt's key only once the attempt is dead, at any moment after;
 *   - a holder whose deadline passes is cancelled at once (G4); a client that decides after
 *     its deadline gives the grant back. A client paused for any length of time is one whose
 *     deadline passed meanwhile: so are its requests and writes still in flight;
 *   - every request to every node, and every reply, may be delayed or lost; a node runs a
 *     request as one script. Requests still in flight when the client decides are dropped
 *     (it waited for the answer or the timeout of every node); a release may arrive late;
 *   - a node may restart once and lose its key and counter. Its restart grace (the longest
 *     ttl) outlasts every lease granted before: here, the node grants nothing until every
 *     attempt begun before its restart is dead. A missing counter is seeded from the clock,
 *     above every counter any node has held (Redis: TIME in ms * 1000, fewer than 1,000
 *     grants per ms; lease.pml checks the seed against ticks);
 *   - a holder sends at most one write per grant to a fenced resource; it lands at any later
 *     time;
 *   - at most MAXA acquisition attempts in a run. Renewal is left out (lease.pml checks it
 *     on one server; Redlock's extend is the same owner-checked step on a quorum).
 *
 * Weaker variants (the checker must find each one's violation):
 *   -DTOKEN_BEFORE_QUORUM  the token is the counter of the first node that answered, fewer
 *                          than a majority, not the largest over the quorum (G2)
 *   -DNO_PHASE2            the largest over the quorum, but the counters are not raised (G2)
 *   -DNO_GRACE             a node that lost its data grants at once after its restart (G1)
 *   -DDUPLICATE_NODE       client 1 names node 0 twice: one server's vote counts twice (G1)
 */

#define N        3
#define Q        2      /* quorum: N / 2 + 1 */
#define ALL      7      /* every node, as a bitmask */
#define MAXA     3

/* the client's j-th node -> the server: all distinct, or client 1 naming node 0 twice */
#ifdef DUPLICATE_NODE
#define SRV(i, j)  ((i == 1 && j == 1) -> 0 : j)
#else
#define SRV(i, j)  (j)
#endif

#define IDLE   0        /* client states */
#define P1     1        /* phase 1 sent */
#define P2     2        /* phase 2 sent */
#define HOLD   3

#define BIT(j)       (1 << (j))
#define HAS(m, j)    (((m) >> (j)) & 1)
#define COUNT(m)     (HAS(m, 0) + HAS(m, 1) + HAS(m, 2))

/* nodes */
byte key[N];            /* the attempt whose key the node holds; 0 = none */
byte ctr[N];            /* the counter; 0 = missing */
#ifdef DUPLICATE_NODE
byte ktok[N];           /* the token in the key's value (read only by a repeated request) */
#define KTOK(s, v)  ktok[s] = v
#else
#define KTOK(s, v)  skip
#endif
byte before = 0;        /* attempts begun before the restart: the grace waits for them */
bool restarted = false;
byte attempts = 0;

/* node s is in its restart grace: an attempt begun before the restart still runs */
#define RUNNING(i)  (st[i] != IDLE && att[i] <= before)
#ifdef NO_GRACE
#define GRACE(s)   false
#else
#define GRACE(s)   (s == 0 && (RUNNING(0) || RUNNING(1)))
#endif

/* clients */
byte st[2];
byte att[2];            /* the current attempt */
byte p1[2];             /* phase-1 requests in flight (bitmask of the client's nodes) */
byte gmask[2];          /* the nodes whose phase-1 grant reached the client */
byte gmax[2];           /* the largest and smallest token among them */
byte gmin[2];
#ifdef TOKEN_BEFORE_QUORUM
byte gfirst[2];         /* the token of the first of them */
#define FIRST(i, v)    if :: gmask[i] == 0 -> gfirst[i] = v :: else fi
#define CLEAR_GOT(i)   gmask[i] = 0; gmax[i] = 0; gmin[i] = 0; gfirst[i] = 0
#else
#define FIRST(i, v)    skip
#define CLEAR_GOT(i)   gmask[i] = 0; gmax[i] = 0; gmin[i] = 0
#endif
byte p2[2];             /* phase-2 requests in flight */
byte ack[2];            /* phase-2 acknowledgements */
byte tok[2];            /* the token decided */

/* the fenced resource */
byte fence = 0;
bool wpend[2];          /* a write in flight */
byte wtok[2];
byte wseq[2];

/* ghosts */
byte hi = 0;            /* the highest counter any node has held */
byte grants = 0;        /* grants accepted so far: their order */
byte seq[2];            /* the grant number of the client's hold */
byte maxtok = 0;        /* the highest token accepted */
byte newest = 0;        /* the grant number of the newest write that landed */

/* the attempt ends: its deadline passed, its body ended, or it gave back; its keys go */
inline lose(i) {
  st[i] = IDLE; tok[i] = 0; seq[i] = 0;
  if :: key[0] == att[i] -> key[0] = 0 :: else fi;
  if :: key[1] == att[i] -> key[1] = 0 :: else fi;
  if :: key[2] == att[i] -> key[2] = 0 :: else fi
}

/* forget this attempt's requests and replies; release on every node */
inline give_back(i) {
  p1[i] = 0; p2[i] = 0; ack[i] = 0; CLEAR_GOT(i); lose(i)
}

/* the client accepts the grant of tok[i] */
inline accept(i) {
  if
  :: true ->
       assert(st[1-i] != HOLD);                         /* G1: no other valid holder */
       assert(tok[i] > maxtok);                         /* G2 */
       maxtok = tok[i]; grants++; seq[i] = grants;
       st[i] = HOLD; p1[i] = 0; p2[i] = 0; ack[i] = 0; CLEAR_GOT(i);
       /* the body's write to the fenced resource, sent now, lands at any later time (one
          write in flight per client) */
       if :: !wpend[i] -> wpend[i] = true; wtok[i] = tok[i]; wseq[i] = seq[i] :: else fi
  fi
}

/* the client hears node j's grant of token v (v = 0: busy, or in its grace) */
inline record(i, j, v) {
  if
  :: v != 0 ->
       if :: gmask[i] == 0 || v > gmax[i] -> gmax[i] = v :: else fi;
       if :: gmask[i] == 0 || v < gmin[i] -> gmin[i] = v :: else fi;
       FIRST(i, v);
       gmask[i] = gmask[i] | BIT(j)
  :: else
  fi
}

/* phase 1 at the client's node j (server SRV(i, j)): the acquire script; the reply
   reaches the client (heard) or is lost */
inline phase1(i, j, heard) {
  d_step { HAS(p1[i], j) ->
    p1[i] = p1[i] & ~BIT(j);
    if
#ifdef DUPLICATE_NODE
    :: key[SRV(i, j)] == att[i] -> v = ktok[SRV(i, j)]  /* ours already: the same answer */
#endif
    :: key[SRV(i, j)] == 0 && !GRACE(SRV(i, j)) ->
         if :: ctr[SRV(i, j)] == 0 -> ctr[SRV(i, j)] = hi :: else fi;   /* the seed */
         ctr[SRV(i, j)]++;
         if :: ctr[SRV(i, j)] > hi -> hi = ctr[SRV(i, j)] :: else fi;
         key[SRV(i, j)] = att[i]; KTOK(SRV(i, j), ctr[SRV(i, j)]);
         v = ctr[SRV(i, j)]
    :: else -> v = 0                                    /* busy, or in its grace */
    fi;
    if :: heard -> record(i, j, v) :: else fi;
    v = 0 }
}

/* phase 2 at node j: raise the counter to t where the key is still ours; the
   acknowledgement reaches the client (heard) or is lost */
inline phase2(i, j, heard) {
  d_step { HAS(p2[i], j) ->
    p2[i] = p2[i] & ~BIT(j);
    if
    :: key[SRV(i, j)] == att[i] ->
         if :: ctr[SRV(i, j)] < tok[i] -> ctr[SRV(i, j)] = tok[i] :: else fi;
         KTOK(SRV(i, j), tok[i]);
         if :: heard -> ack[i] = ack[i] | BIT(j) :: else fi
    :: else
    fi }
}

proctype client(byte i) {
  byte v;
end:
  do
     /* phase 1: t_send is read before sending to every node */
  :: d_step { st[i] == IDLE && attempts < MAXA ->
       attempts++; att[i] = attempts; st[i] = P1; p1[i] = ALL }
  :: phase1(i, 0, true)
  :: phase1(i, 0, false)
  :: phase1(i, 1, true)
  :: phase1(i, 1, false)
  :: phase1(i, 2, true)
  :: phase1(i, 2, false)
  :: phase2(i, 0, true)
  :: phase2(i, 0, false)
  :: phase2(i, 1, true)
  :: phase2(i, 1, false)
  :: phase2(i, 2, true)
  :: phase2(i, 2, false)
     /* every phase-1 answer is in, or the rest timed out (their requests or replies lost):
        decide with what came back */
  :: d_step { st[i] == P1 ->
       if
       :: COUNT(gmask[i]) >= Q ->
#ifdef TOKEN_BEFORE_QUORUM
            tok[i] = gfirst[i];                         /* the first reply's counter */
#else
            tok[i] = gmax[i];
#endif
            if
#ifndef NO_PHASE2
            :: gmin[i] != tok[i] || gmax[i] != tok[i] ->   /* the quorum disagrees */
                 st[i] = P2; ack[i] = 0; p2[i] = gmask[i]; CLEAR_GOT(i)
#endif
            :: else -> accept(i)
            fi
       :: else -> give_back(i)
       fi }
     /* every phase-2 answer is in, or the rest timed out */
  :: d_step { st[i] == P2 ->
       if
       :: COUNT(ack[i]) >= Q -> accept(i)
       :: else -> give_back(i)
       fi }
     /* the write lands, maybe long after (its sender's lease expired meanwhile) */
  :: d_step { wpend[i] ->
       if
       :: wtok[i] >= fence -> fence = wtok[i];
            assert(wseq[i] >= newest);                  /* G3 */
            newest = wseq[i]
       :: else                                          /* StaleToken: refused */
       fi;
       wpend[i] = false; wtok[i] = 0; wseq[i] = 0 }
     /* the attempt's local deadline passes: a holder is cancelled at once, an attempt gives
        back; or the body ends and releases */
  :: d_step { st[i] != IDLE -> give_back(i) }
  od
}

init {
  atomic { run client(0); run client(1) };
end:
  do
     /* node 0 restarts and loses its key and counter (the nodes are interchangeable: each
        client asks all of them and the checker picks which answer, so this is any node);
        its grace waits for every attempt begun so far */
  :: d_step { !restarted ->
       restarted = true; key[0] = 0; ctr[0] = 0;
       before = attempts }
  od
}
