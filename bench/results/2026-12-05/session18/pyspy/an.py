import sys, collections
def load(d):
    leaf = collections.Counter(); incl = collections.Counter(); tot = 0
    for line in open(f"{d}/spy.txt"):
        stack, n = line.rsplit(" ", 1); n = int(n); tot += n
        frames = stack.split(";")
        def key(f):
            name = f.split(" (")[0]; loc = f.split(" (")[1].rstrip(")") if " (" in f else ""
            return f"{name} ({'/'.join(loc.split(':')[0].split('/')[-2:])})"
        leaf[key(frames[-1])] += n
        for k in set(map(key, frames)): incl[k] += n
    return tot, leaf, incl
a = load(sys.argv[1]); b = load(sys.argv[2])
print("total", a[0], b[0])
which = 1 if sys.argv[3] == "leaf" else 2
keys = set(a[which]) | set(b[which])
rows = sorted(keys, key=lambda k: -(b[which][k] - a[which][k]))
for k in rows[:35]: print(f"{a[which][k]:5d} {b[which][k]:5d} {b[which][k]-a[which][k]:+5d} {k}")
print("...")
for k in rows[-12:]: print(f"{a[which][k]:5d} {b[which][k]:5d} {b[which][k]-a[which][k]:+5d} {k}")
