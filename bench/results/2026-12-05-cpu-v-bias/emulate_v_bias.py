import os, sys, time, math
import numpy as np
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '../../../python'))
from emulate_common import dec_e4m3, e4m3_mag_code, int8_rows, int8_kgroups, p_codes, make_inputs
from open_vc_attn.bench.qk_formats import dequantize
from emulate_v_rounding import quant_v_head
names = sys.argv[1].split(',') if len(sys.argv) > 1 and sys.argv[1] else None
inp = make_inputs(4096, 4, 128, seed=int(sys.argv[2]) if len(sys.argv) > 2 else 0)
for name, (q, k, v, desc) in inp.items():
    if names and not any(n in name for n in names): continue
    t0 = time.time(); D = q.shape[-1]; tau = 1 / math.sqrt(D)
    ks = k - k.mean(0, keepdims=True)
    Q = {'int8s': (int8_rows(q.astype(np.float64)), int8_kgroups(ks.astype(np.float64))),
         'e4m3': (np.stack([dequantize(q[:, i], 'e4m3', 128) for i in range(q.shape[1])], 1),
                  np.stack([dequantize(k[:, i], 'e4m3', 128) for i in range(q.shape[1])], 1))}
    errs = {}
    for h in range(q.shape[1]):
        s_ex = (q[:, h].astype(np.float64) @ k[:, h].astype(np.float64).T) * tau
        pe = np.exp(s_ex - s_ex.max(1, keepdims=True)); ref = (pe @ v[:, h].astype(np.float64)) / pe.sum(1, keepdims=True); del pe, s_ex
        vq, _ = quant_v_head(v[:, h], 0, 0, 'greedy'); vg, bias = quant_v_head(v[:, h], 0, 0, 'global')
        for qn, (qd, kd) in Q.items():
            s8 = (qd[:, h] @ kd[:, h].T) * tau
            pms = {'expcast': p_codes(s8, 'expcast')}
            if qn == 'int8s':
                pms['exp2'] = p_codes(s8, 'exp2')
                hyb = pms['expcast'].copy(); hyb[:, 0::2] = pms['exp2'][:, 0::2]; pms['half'] = hyb
            for pm, p in pms.items():
                l = p.sum(1, keepdims=True)
                for vn, o in (('rne', (p @ vq) / l), ('bias', (p @ vg) / l + bias)):
                    e = errs.setdefault(f'{qn}/{pm}/{vn}', [0.0, 0.0]); e[0] += float(((o - ref) ** 2).sum()); e[1] += float((ref ** 2).sum())
    print(f'{name:22s} ' + ' '.join(f'{k_}={math.sqrt(a/b)*100:.2f}' for k_, (a, b) in errs.items()) + f' ({time.time()-t0:.0f}s)', flush=True)
