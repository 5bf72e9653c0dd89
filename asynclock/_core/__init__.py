"""Private core of asynclock. Import the public API from :mod:`asynclock`.

Words, one meaning each (docs/concepts.md lists them too):

* lease: the server's grant of a lock name to one owner for ``ttl`` seconds (:class:`Lease`).
* owner: the id of one acquisition (``lease.owner``); only it may renew or release the lease.
* token: a lease's fencing token, larger than every earlier grant's of its name (or scope).
* hold: the time a body works under a lease, grant to release or loss (``max_hold``,
  ``HoldTimes``); to hold a lock is to be inside one.
* held: the state of a name or lease between grant and end (``backend.held()``, ``LockHeld``).
* holder: who holds a lock (a task, process or node); ``backend.holder(name)`` is the
  server's view of it, a :class:`Holder`.
* term: a lease won by ``leadership()``; it carries the leader's identity.

So the per-context stack of current leases is ``context.LEASES`` (of ``Entry``), and what
granted a lease is its ``Grantor``: neither is a hold nor a holder.
"""
