"""``prunopt train --method probmask`` (filled in with the ProbMask job)."""
