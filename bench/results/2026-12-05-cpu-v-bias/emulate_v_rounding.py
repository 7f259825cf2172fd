import os, sys, time, math
import numpy as np
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '../../../python'))
from emulate_common import dec_e4m3, e4m3_mag_code, int8_rows, int8_kgroups, p_codes, make_inputs

def quant_v_head(x0, group, kmax, mode='greedy'):
    S, D = x0.shape
    amax = np.abs(x0).max(); sc = np.float32(448.0) / np.float32(amax)
    x = (x0.astype(np.float32) * sc).astype(np.float64)
    mc, qm = e4m3_mag_code(np.abs(x)); q = np.sign(x) * qm
    if mode == 'global':   # add back the per-channel mean residual (as an output bias)
        return q / float(sc), (x - q).mean(0) / float(sc)
    if group == 0: return q / float(sc), None
    nb = S // group
    xb = x.reshape(nb, group, D).transpose(0, 2, 1).reshape(-1, group)
    qb = q.reshape(nb, group, D).transpose(0, 2, 1).reshape(-1, group).copy()
    mcb = mc.reshape(nb, group, D).transpose(0, 2, 1).reshape(-1, group)
    ax = np.abs(xb); aq = np.abs(qb)
    oc = np.clip(mcb + np.where(ax > aq, 1, np.where(ax < aq, -1, 0)), 0, 126)
    qo = np.sign(xb) * dec_e4m3(oc)
    r = xb - qb; ro = xb - qo
    R = r.sum(1); flipped = np.zeros(qb.shape, bool); nflip = np.zeros(len(R), int)
    for it in range(kmax):
        Rn = R[:, None] - r + ro
        cand = (np.abs(Rn) < np.abs(R)[:, None]) & ~flipped & (oc != mcb)
        if not cand.any(): break
        if mode == 'greedy': cost = np.where(cand, ro * ro - r * r, np.inf)
        else: cost = np.where(cand, -np.abs(r) / np.abs(ro - r + 1e-300), np.inf)   # largest |t| first
        j = cost.argmin(1); rows = np.nonzero(cand.any(1))[0]; jj = j[rows]
        R[rows] = Rn[rows, jj]; qb[rows, jj] = qo[rows, jj]; flipped[rows, jj] = True; nflip[rows] += 1
    q = qb.reshape(nb, D, group).transpose(0, 2, 1).reshape(S, D)
    return q / float(sc), nflip

VARIANTS = [('rne', 0, 0, 'greedy'), ('global', 0, 0, 'global'), ('g128', 128, 64, 'greedy'), ('g128k4', 128, 4, 'greedy'),
            ('g128t', 128, 64, 'tfirst'), ('g64', 64, 64, 'greedy'), ('g32', 32, 64, 'greedy'), ('g16', 16, 64, 'greedy'),
            ('g16k2', 16, 2, 'greedy'), ('g16k1', 16, 1, 'greedy')]

if __name__ == "__main__":
    def rel(o, r): return float(np.linalg.norm(o - r) / np.linalg.norm(r))
    names = sys.argv[1].split(',') if len(sys.argv) > 1 and sys.argv[1] else None
    inp = make_inputs(4096, 4, 128, seed=int(sys.argv[2]) if len(sys.argv) > 2 else 0)
    for name, (q, k, v, desc) in inp.items():
        if names and not any(n in name for n in names): continue
        t0 = time.time(); D = q.shape[-1]; tau = 1 / math.sqrt(D)
        ks = k - k.mean(0, keepdims=True)
        qd = int8_rows(q.astype(np.float64)); kd = int8_kgroups(ks.astype(np.float64))
        errs = {}; flips = {}
        for h in range(q.shape[1]):
            s_ex = (q[:, h].astype(np.float64) @ k[:, h].astype(np.float64).T) * tau
            pe = np.exp(s_ex - s_ex.max(1, keepdims=True)); ref = (pe @ v[:, h].astype(np.float64)) / pe.sum(1, keepdims=True); del pe, s_ex
            s8 = (qd[:, h] @ kd[:, h].T) * tau
            P = {pm: p_codes(s8, pm) for pm in ('expcast', 'exp2')}; del s8
            for vn, g, km, mode in VARIANTS:
                vq, extra = quant_v_head(v[:, h], g, km, mode)
                if mode != 'global' and extra is not None: flips.setdefault(vn, []).append(extra.mean())
                for pm, p in P.items():
                    o = (p @ vq) / p.sum(1, keepdims=True)
                    if mode == 'global': o = o + extra
                    e = errs.setdefault((pm, vn), [0.0, 0.0]); e[0] += float(((o - ref) ** 2).sum()); e[1] += float((ref ** 2).sum())
        line = ' '.join(f'{pm}/{vn}={math.sqrt(a/b)*100:.2f}' for (pm, vn), (a, b) in errs.items())
        print(f'{name:22s} {line}  flips/grp ' + ' '.join(f'{k_}:{np.mean(v_):.1f}' for k_, v_ in flips.items()) + f' ({time.time()-t0:.0f}s)', flush=True)
