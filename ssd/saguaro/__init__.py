"""SSD (speculative speculative decoding, the Saguaro algorithm), whole.

While the target verifies a speculation, the draft predicts the verification
outcome (k, t*) and prepares the next speculation for each likely one; a
round whose outcome was prepared (a hit) starts at once.

Read in this order:
- target.py      the target side: SSDEngine on the one round loop (ssd.engine.batch), one
                 rounds/proposals exchange per step, verification, degraded rounds, link adoption
- protocol.py    the wire messages between the two sides
- speculator.py  the draft side: answer each outcome from the cache (hit) or a backup (miss),
                 then build the next cache while the target verifies
- cache.py, builder.py, branches.py, backups.py: the cache, its construction (glue pass, top-F_k
                 guesses, branch decoding), and the backups for misses
- host.py        the one draft-side host (a thread, a Ray actor, a second process)
Pure math, free of models and I/O:
- fanout.py      how the branch budget spreads over acceptance lengths; the online estimators
- sampling.py    Saguaro sampling (q' rescaled on the cached guesses)
- batch_policy.py  the batch policy: SSD's speedup at batch b, the backup crossover b*, K by batch size
"""
