"""Synthetic users over the digits training set: Zipf(1.8) user sizes (capped at 100), records assigned at random.

Writes zipf_users.txt (one user id per training record, digits' 1437 in order). Public randomness (seed 0).
"""

import numpy as np

rng = np.random.default_rng(0)
n = 1437
sizes: list[int] = []
while sum(sizes) < n:
    sizes.append(int(min(rng.zipf(1.8), 100)))
sizes[-1] -= sum(sizes) - n
ids = [u for u, s in enumerate(sizes) for _ in range(s)]
owner = [0] * n
for j, i in enumerate(rng.permutation(n)):
    owner[i] = ids[j]
with open("zipf_users.txt", "w") as f:
    f.write("\n".join(map(str, owner)) + "\n")
print(f"{len(sizes)} users, sizes: median {int(np.median(sizes))}, mean {np.mean(sizes):.2f}, max {max(sizes)}")
