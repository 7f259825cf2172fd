"""Medians per library of a twenty-second-session A/B log: each line '[LIB ROUND cC] S=...' (the default line: kernel on
prepared Q, kernel with Q quantized in it) and the 'onecall ...' line after it (one-call and step-wise complete calls).
Usage: python3 ab_summary.py ab.log"""
import re,sys,statistics as st
from collections import defaultdict
d=defaultdict(list)
lib=i=c=None
for line in open(sys.argv[1]):
    line=line.strip()
    m=re.match(r"\[(\w+) (\d+) c(\d)\] (.*)",line)
    if m: lib,i,c,rest=m.groups()
    else: rest=line
    if rest.startswith("S="):
        mm=re.match(r"S=(\d+) H=(\d+) B=(\d+).*attention ([\d.]+) ms ([\d.]+) TFLOP/s \| Q in the kernel ([\d.]+) ms ([\d.]+) TFLOP/s",rest)
        S,H,B,ta,fa,tf,ff=mm.groups()
        key=f"{'causal ' if c=='1' else ''}S={S} H={H} B={B}"
        d[(key,"kernel, prepared Q",lib)].append(float(fa)); d[(key,"kernel, Q in it",lib)].append(float(ff))
    elif rest.startswith("onecall"):
        mm=re.match(r"onecall( packed)? S=(\d+) Sk=(\d+) H=(\d+) B=(\d+): one-call ([\d.]+) TFLOP/s, step-wise ([\d.]+)",rest)
        pk,S,Sk,H,B,a,b=mm.groups()
        key=f"{'causal ' if c=='1' else ''}S={S} H={H} B={B}{' packed' if pk else ''}"
        d[(key,"one-call complete",lib)].append(float(a)); d[(key,"step-wise complete",lib)].append(float(b))
libs=sorted({k[2] for k in d})
rows=sorted({(k[0],k[1]) for k in d})
print("| case | TFLOP/s | "+" | ".join(libs)+f" | {libs[-1]} / {libs[0]} (medians) |")
print("|---|---|"+"---|"*len(libs)+"---|")
for key,met in rows:
    vals=[d.get((key,met,l),[]) for l in libs]
    meds=[st.median(v) if v else float('nan') for v in vals]
    print(f"| {key} | {met} | "+" | ".join(f"{m:.1f} ({' '.join(f'{x:.0f}' for x in v)})" for m,v in zip(meds,vals))+f" | {meds[-1]/meds[0]:.4f} |")
