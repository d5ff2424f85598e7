import os

# Before anything loads torch's OpenMP: spinning threads of idle in-process servers would steal
# the two cores from the one computing (see client/cli.py `main`).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
