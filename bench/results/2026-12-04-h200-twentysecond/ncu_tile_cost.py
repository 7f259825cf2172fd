import csv,sys,collections
def load(fn):
    rows=list(csv.reader(open(fn)))
    h=next(i for i,r in enumerate(rows) if r and r[0]=="Address")
    hdr=rows[h]; idx={k:i for i,k in enumerate(hdr)}
    data=[r for r in rows[h+1:] if len(r)==len(hdr)]
    out=[]
    for r in data:
        f=lambda k: float(r[idx[k]].replace(',','') or 0) if r[idx[k]] not in ('-','') else 0.0
        reasons={k:f(k) for k in hdr if k.startswith('stall_') and 'Not Issued' not in k}
        out.append((r[0],r[1].strip(),f('Warp Stall Sampling (All Samples)'),f('Instructions Executed'),reasons))
    return out
fn,tiles=sys.argv[1],int(sys.argv[2])
d=load(fn)
tot=sum(x[2] for x in d)
per_tile=tiles*8
cls=collections.Counter(); 
for a,s,smp,ex,rs in d:
    if ex==0: c='never'
    elif ex<=1584*1.01: c='once per CTA'
    elif ex<per_tile*0.3: c='producer-ish (< 0.3 per consumer tile-warp)'
    elif ex<=per_tile*2.5: c='per tile (consumer)'
    else: c='loop'
    cls[c]+=smp
for c,v in cls.most_common(): print(f"{c:45s} {100*v/tot:5.1f}%")
print("top per-tile instructions:")
pt=[x for x in d if per_tile*0.3<=x[3]<=per_tile*2.5]
pt.sort(key=lambda x:-x[2])
for a,s,smp,ex,rs in pt[:25]:
    top=sorted(rs.items(),key=lambda kv:-kv[1])[:2]
    print(f"  {100*smp/tot:5.2f}% ex={ex/per_tile:4.2f}/tile-warp {s[:60]:60s} "+", ".join(f"{k[6:]} {100*v/max(smp,1):.0f}%" for k,v in top))
