import os, sys, time, math
import numpy as np
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '../../../python'))
from open_vc_attn.bench.qk_tradeoff import make_inputs
from open_vc_attn.bench.qk_formats import e4m3_round

LOG2E = 1.4426950408889634

def dec_e4m3(c):
    c = c.astype(np.int64)
    e = c >> 3; m = c & 7
    return np.where(e > 0, np.ldexp(1.0 + m / 8.0, (e - 7).astype(np.int32)), m * 2.0 ** -9)

def e4m3_mag_code(a):   # a >= 0, RNE, satfinite at 448 (code 126)
    r = e4m3_round(a.astype(np.float32)).astype(np.float64)
    # code from value
    code = np.zeros(a.shape, np.int64)
    nz = r > 0
    ex = np.floor(np.log2(np.where(nz, r, 1.0))).astype(np.int64)
    norm = nz & (ex >= -6)
    mant = np.where(norm, np.round((r / np.ldexp(1.0, ex.astype(np.int32)) - 1) * 8), 0).astype(np.int64)
    code = np.where(norm, (ex + 7) * 8 + mant, np.round(r / 2.0 ** -9).astype(np.int64))
    return code, r

def quant_v(v, mode):
    # v: [S, H, D]; per head scale; returns dequantized values in v units
    S, H, D = v.shape
    out = np.empty_like(v, dtype=np.float64)
    for h in range(H):
        x0 = v[:, h, :].astype(np.float32)
        amax = np.abs(x0).max()
        sc = np.float32(448.0) / np.float32(amax)
        x = (x0 * sc).astype(np.float64)
        mc, qm = e4m3_mag_code(np.abs(x))
        q = np.sign(x) * qm
        if mode == 'mp':
            nb = S // 128
            xb = x[: nb * 128].reshape(nb, 128, D).transpose(0, 2, 1).reshape(-1, 128)
            qb = q[: nb * 128].reshape(nb, 128, D).transpose(0, 2, 1).reshape(-1, 128).copy()
            mcb = mc[: nb * 128].reshape(nb, 128, D).transpose(0, 2, 1).reshape(-1, 128)
            ax = np.abs(xb); aq = np.abs(qb)
            oc = np.clip(mcb + np.where(ax > aq, 1, np.where(ax < aq, -1, 0)), 0, 126)
            qo = np.sign(xb) * dec_e4m3(oc)
            r = xb - qb; ro = xb - qo
            R = r.sum(1)
            flipped = np.zeros(qb.shape, bool)
            for it in range(32):
                Rn = R[:, None] - r + ro
                cand = (np.abs(Rn) < np.abs(R)[:, None]) & ~flipped & (oc != mcb)
                if not cand.any(): break
                cost = np.where(cand, ro * ro - r * r, np.inf)
                j = cost.argmin(1)
                rows = np.nonzero(cand.any(1))[0]
                jj = j[rows]
                R[rows] = Rn[rows, jj]
                qb[rows, jj] = qo[rows, jj]
                flipped[rows, jj] = True
            q = q.copy()
            q[: nb * 128] = qb.reshape(nb, D, 128).transpose(0, 2, 1).reshape(nb * 128, D)
        out[:, h, :] = q / float(sc)
    return out

def int8_rows(x):  # per row over D
    amax = np.abs(x).max(-1, keepdims=True)
    s = np.where(amax > 0, 127.0 / amax, 0)
    return np.clip(np.rint(x * s), -127, 127) / np.where(s > 0, s, 1)

def int8_kgroups(k, g=16):
    S, H, D = k.shape
    kk = k.reshape(S // g, g, H, D)
    amax = np.abs(kk).max(axis=(1, 3), keepdims=True)
    s = np.where(amax > 0, 127.0 / amax, 0)
    return (np.clip(np.rint(kk * s), -127, 127) / np.where(s > 0, s, 1)).reshape(S, H, D)

def p_codes(s, mode):
    # s: [S, S] scores in nats, per row max subtraction
    u = s - s.max(1, keepdims=True)
    if mode == 'expcast':
        c = np.clip(np.rint(8 * LOG2E * u + 119.65), 0, 120)
        return dec_e4m3(c)
    else:
        mc, r = e4m3_mag_code(256.0 * np.exp(u))
        return r

def attn(q, k, v, tau, p_mode):
    out = np.empty(q.shape, np.float64)
    for h in range(q.shape[1]):
        s = (q[:, h].astype(np.float64) @ k[:, h].astype(np.float64).T) * tau
        p = p_codes(s, p_mode) if p_mode else np.exp(s - s.max(1, keepdims=True))
        out[:, h] = (p @ v[:, h]) / p.sum(1, keepdims=True)
    return out

def rel(o, r): return float(np.linalg.norm(o - r) / np.linalg.norm(r))

if __name__ == "__main__":
    names = sys.argv[1].split(',') if len(sys.argv) > 1 else None
    inp = make_inputs(4096, 4, 128, seed=int(sys.argv[2]) if len(sys.argv) > 2 else 0)
    for name, (q, k, v, desc) in inp.items():
        if names and not any(n in name for n in names): continue
        t0 = time.time()
        D = q.shape[-1]; tau = 1 / math.sqrt(D)
        ref = attn(q, k, v.astype(np.float64), tau, None)
        ks = k - k.mean(0, keepdims=True)
        qd = int8_rows(q.astype(np.float64)); kd = int8_kgroups(ks.astype(np.float64))
        vr = quant_v(v, 'rne'); vm = quant_v(v, 'mp')
        res = {}
        for pm in ('expcast', 'exp2'):
            for vn, vv in (('rne', vr), ('mp', vm)):
                res[f'{pm}/{vn}'] = rel(attn(qd, kd, vv, tau, pm), ref)
        res['exactQK+exp2/rne'] = rel(attn(q, k, vr, tau, 'exp2'), ref)
        res['exactQK+exp2/mp'] = rel(attn(q, k, vm, tau, 'exp2'), ref)
        res['V only rne'] = rel(attn(q, k, vr, tau, None), ref)
        res['V only mp'] = rel(attn(q, k, vm, tau, None), ref)
        print(f'{name:24s}', ' '.join(f'{k_}={v_*100:.2f}%' for k_, v_ in res.items()), f'({time.time()-t0:.0f}s)', flush=True)
