"""The formulas of the CUDA chunkwise mLSTM forward (h, final states) and backward (src/cuda/mlstm/mlstm_bwd.cu, kernels K0..K4; design:
docs/design/mlstm_backward.md), emulated chunk by chunk in float64 torch exactly as the kernels compute
them (chunk states, row statistics, reverse state-gradient scan, dq / dk / dv / gate terms, the scalar
correction through m), against full autograd of an independent recurrent implementation. This checks
the kernels' mathematics on any machine; the GPU suites check their implementation.
"""

from __future__ import annotations

import math

import pytest
import torch

def ref(q,k,v,i,f,c0,n0,m0,eps):
    NH,S,D=q.shape; DV=v.shape[-1]
    c=c0.clone(); n=n0.clone(); m=m0.clone()
    lf=torch.nn.functional.logsigmoid(f); hs=[]
    for t in range(S):
        mn=torch.maximum(lf[:,t]+m,i[:,t]); fa=torch.exp(lf[:,t]+m-mn); ia=torch.exp(i[:,t]-mn)
        c=fa[:,None,None]*c+ia[:,None,None]*k[:,t,:,None]*v[:,t,None,:]; n=fa[:,None]*n+ia[:,None]*k[:,t]
        qs=q[:,t]/math.sqrt(D); num=torch.einsum('hd,hde->he',qs,c)
        den=torch.maximum((qs*n).sum(-1).abs(),torch.exp(-mn))+eps; hs.append(num/den[:,None]); m=mn
    return torch.stack(hs,1),c,n,m

def emu(q,k,v,i,f,c0,n0,m0,eps,L,dh,dcl,dnl,dml):
    # one head at a time
    NH,S,DQK=q.shape; DV=v.shape[-1]; scale=1/math.sqrt(DQK)
    out={x:[] for x in 'h c n m dq dk dv di df dc0 dn0 dm0 g_states g_qdq'.split()}
    for h in range(NH):
        NC=(S+L-1)//L
        # K0 states
        C=[c0[h].clone()]; N=[n0[h].clone()]; M=[float(m0[h])]
        gates=[]
        for kc in range(NC):
            t0=kc*L; nn=min(L,S-t0)
            lf=torch.nn.functional.logsigmoid(f[h,t0:t0+nn]); g=torch.cumsum(lf,0); a=i[h,t0:t0+nn]-g
            Mt=torch.maximum(torch.cummax(a,0).values, torch.tensor(M[kc], dtype=torch.float64))
            gates.append((g,a,Mt))
            ML=Mt[-1]; G=g[-1]; w=torch.exp(a-ML); dk_=torch.exp(M[kc]-ML)
            C.append(dk_*C[kc]+(w[:,None]*k[h,t0:t0+nn]).T@v[h,t0:t0+nn]); N.append(dk_*N[kc]+(w[:,None]*k[h,t0:t0+nn]).sum(0))
            M.append(float(G+ML))
        # K1 rows
        hrows=[]
        inv_den=torch.zeros(S, dtype=torch.float64); db=torch.zeros(S, dtype=torch.float64); corr=torch.zeros(S, dtype=torch.float64); eY=torch.zeros(S, dtype=torch.float64)
        for kc in range(NC):
            t0=kc*L; nn=min(L,S-t0); g,a,Mt=gates[kc]; mk=M[kc]
            qq=q[h,t0:t0+nn]; kk=k[h,t0:t0+nn]; vv=v[h,t0:t0+nn]; dd=dh[h,t0:t0+nn]
            e=torch.exp(mk-Mt)
            D=torch.exp(a[None,:]-Mt[:,None])*torch.tril(torch.ones(nn, nn, dtype=torch.float64))
            P=scale*(qq@kk.T)*D
            qn=qq@N[kc]; b=scale*e*qn+P.sum(1)
            inter_num=(scale*e)[:,None]*(qq@C[kc]); intra_num=P@vv
            si=(dd*inter_num).sum(1); sa=(dd*intra_num).sum(1)
            mt=g+Mt; em=torch.exp(-mt); den=torch.maximum(b.abs(),em)+eps
            hdot=(si+sa)/den; dden=-hdot/den
            dbv=torch.where(b.abs()>em, dden*torch.sign(b), torch.where(b.abs()<em, 0*dden, 0.5*dden*torch.sign(b)))
            inv_den[t0:t0+nn]=1/den; db[t0:t0+nn]=dbv; corr[t0:t0+nn]=eps*dden; eY[t0:t0+nn]=si/den+scale*e*qn*dbv
            hrows.append((inter_num+intra_num)/den[:,None])  # the forward's kernel B
        # K2 scan
        dC=[None]*(NC+1); dN=[None]*(NC+1); R=[0.0]*(NC+1)
        dCc=dcl[h].clone(); dNc=dnl[h].clone()
        R[NC]=float((C[NC]*dCc).sum()+(N[NC]*dNc).sum())
        for kc in range(NC-1,-1,-1):
            dC[kc+1]=dCc.clone(); dN[kc+1]=dNc.clone()
            R[kc]=float((C[kc]*dCc).sum()+(N[kc]*dNc).sum())
            t0=kc*L; nn=min(L,S-t0); g,a,Mt=gates[kc]; mk=M[kc]
            decay=math.exp(mk-float(Mt[-1]))
            es=scale*torch.exp(mk-Mt)
            qq=q[h,t0:t0+nn]; dnum=dh[h,t0:t0+nn]*inv_den[t0:t0+nn,None]
            dCc=decay*dCc+(es[:,None]*qq).T@dnum; dNc=decay*dNc+((es*db[t0:t0+nn])[:,None]*qq).sum(0)
        out['dc0'].append(dCc); out['dn0'].append(dNc)
        # K3
        dq=torch.zeros(S, DQK, dtype=torch.float64); dk=torch.zeros(S, DQK, dtype=torch.float64); dv=torch.zeros(S, DV, dtype=torch.float64); dgq=torch.zeros(S, dtype=torch.float64); dgkv=torch.zeros(S, dtype=torch.float64); dikv=torch.zeros(S, dtype=torch.float64)
        Gp=[0.0]*NC; QI=[0.0]*NC
        for kc in range(NC):
            t0=kc*L; nn=min(L,S-t0); g,a,Mt=gates[kc]; mk=M[kc]; ML=Mt[-1]
            qq=q[h,t0:t0+nn]; kk=k[h,t0:t0+nn]; vv=v[h,t0:t0+nn]
            idn=inv_den[t0:t0+nn]; dbc=db[t0:t0+nn]; dnum=dh[h,t0:t0+nn]*idn[:,None]
            e=torch.exp(mk-Mt); D=torch.exp(a[None,:]-Mt[:,None])*torch.tril(torch.ones(nn, nn, dtype=torch.float64))
            X=(dh[h,t0:t0+nn]@vv.T)*idn[:,None]+dbc[:,None]   # X[t,s]
            W=D*X; P=scale*(qq@kk.T)*D; Z=P*X
            dq[t0:t0+nn]=scale*(e[:,None]*(dnum@C[kc].T+N[kc][None,:]*dbc[:,None]) + W@kk)
            dgq[t0:t0+nn]=Z.sum(1)+eY[t0:t0+nn]
            QI[kc]=float((qq*dq[t0:t0+nn]).sum()-Z.sum())  # q . dq's inter-chunk part, summed over the chunk
            assert abs(QI[kc]-float(eY[t0:t0+nn].sum()))<=1e-12*max(1.0,abs(QI[kc]))  # = the chunk's sum of eY (K3q's)
            w=torch.exp(a-ML)
            dCv=vv@dC[kc+1].T   # (s, r)
            dk[t0:t0+nn]=W.T@(scale*qq)+w[:,None]*(dCv+dN[kc+1][None,:])
            dv[t0:t0+nn]=P.T@dnum+w[:,None]*(kk@dC[kc+1])
            U=(kk*(dCv+dN[kc+1][None,:])).sum(1)
            da=Z.sum(0)+w*U
            dikv[t0:t0+nn]=da; dgkv[t0:t0+nn]=-da; Gp[kc]=float((w*U).sum())
        # The chunk decay's gradient G_kc = Gp_kc + d_kc R_kc (K4 below) needs R_kc = <C_k, dC_k+1> + <n_k,
        # dn_k+1>, which K2 forms by reading every chunk state. The same G without those reads (the plan
        # in docs/perf/mlstm.md, session 32): G_NC-1 = R_NC (the final states only), then
        # G_kc = G_kc+1 - Gp_kc+1 + QI_kc+1, QI the chunk's sum of q . dq's inter-chunk part (K3q's).
        Grec=[0.0]*NC
        if NC: Grec[NC-1]=R[NC]
        for kc in range(NC-2,-1,-1): Grec[kc]=Grec[kc+1]-Gp[kc+1]+QI[kc+1]
        out['g_states'].append(torch.tensor([Gp[kc]+math.exp(M[kc]-float(gates[kc][2][-1]))*R[kc] for kc in range(NC)], dtype=torch.float64))
        out['g_qdq'].append(torch.tensor(Grec, dtype=torch.float64))
        # K4
        dlf=torch.zeros(S, dtype=torch.float64); di=dikv.clone(); dm0=0.0
        for kc in range(NC):
            t0=kc*L; nn=min(L,S-t0); g,a,Mt=gates[kc]; mk=M[kc]
            dkk=math.exp(mk-float(Mt[-1])); G=Gp[kc]+dkk*R[kc]
            if kc==0: dm0+=dkk*R[0]+float(eY[t0:t0+nn].sum())
            acc=G
            for t in range(nn-1,-1,-1):
                acc+=float(dgq[t0+t]+dgkv[t0+t]); dlf[t0+t]=acc
        cS=float(dml[h])-R[NC]
        mrec=[]; mm=float(m0[h])
        for t in range(S):
            lf=float(torch.nn.functional.logsigmoid(f[h,t])); mm=max(lf+mm,float(i[h,t])); mrec.append(mm)
        d=cS if S==0 else 0.0
        for t in range(S-1,-1,-1):
            d+=float(corr[t])+(cS if t==S-1 else 0.0)
            lf=float(torch.nn.functional.logsigmoid(f[h,t])); mp=mrec[t-1] if t>0 else float(m0[h])
            A=lf+mp; Bv=float(i[h,t])
            if A>Bv: dlf[t]+=d
            elif A<Bv: di[t]+=d; d=0.0
            else: dlf[t]+=0.5*d; di[t]+=0.5*d; d*=0.5
        dm0+=d
        out['h'].append(torch.cat(hrows, 0) if hrows else torch.zeros(0, DV, dtype=torch.float64))
        out['c'].append(C[NC]); out['n'].append(N[NC]); out['m'].append(torch.tensor(M[NC], dtype=torch.float64))
        out['dq'].append(dq); out['dk'].append(dk); out['dv'].append(dv); out['di'].append(di)
        out['df'].append(dlf*torch.sigmoid(-f[h])); out['dm0'].append(torch.tensor(dm0, dtype=torch.float64))
    return {k_:torch.stack(v_) for k_,v_ in out.items()}


@pytest.mark.parametrize("S,L,iscale,fshift,eps", [(1, 16, 2, 3, 1e-6), (37, 16, 2, 3, 1e-6), (64, 64, 2, 3, 1e-6),
                                                   (100, 32, 20, -20, 1e-6), (70, 16, 3, 0, 0.3), (50, 16, 2, 3, 0.0)])
def test_kernel_formulas_equal_the_exact_gradient(S, L, iscale, fshift, eps):
    g0 = torch.Generator().manual_seed(S + L)
    NH, DQK, DV = 2, 6, 5
    r = lambda *s: torch.randn(*s, generator=g0, dtype=torch.float64)  # noqa: E731
    q, k, v = (r(NH, S, d).requires_grad_() for d in (DQK, DQK, DV))
    i = (r(NH, S) * iscale).requires_grad_()
    f = (r(NH, S) + fshift).requires_grad_()
    c0, n0, m0 = (r(*s).requires_grad_() for s in ((NH, DQK, DV), (NH, DQK), (NH,)))
    dh, dcl, dnl, dml = r(NH, S, DV), r(NH, DQK, DV), r(NH, DQK), r(NH)
    args = (q, k, v, i, f, c0, n0, m0)
    h, c, n, m = ref(*args, eps)
    want = torch.autograd.grad((h * dh).sum() + (c * dcl).sum() + (n * dnl).sum() + (m * dml).sum(), args)
    got = emu(*(x.detach() for x in args), eps, L, dh, dcl, dnl, dml)
    for name, w in (("h", h), ("c", c), ("n", n), ("m", m)):  # the forward kernels' formulas too
        w = w.detach()
        assert float((got[name] - w).norm() / max(float(w.norm()), 1e-300)) < 1e-12, name
    for name, w in zip("dq dk dv di df dc0 dn0 dm0".split(), want):
        err = float((got[name] - w).norm() / max(float(w.norm()), 1e-300))
        assert err < 1e-11, (name, err)


@pytest.mark.parametrize("S,L,iscale,fshift,eps", [(1, 16, 2, 3, 1e-6), (37, 16, 2, 3, 1e-6), (100, 32, 20, -20, 1e-6),
                                                   (70, 16, 3, 0, 0.3), (300, 16, 2, -3, 1e-6)])
def test_chunk_decay_gradient_without_the_state_reads(S, L, iscale, fshift, eps):
    """K2 reads every chunk state C_k only for R_k = <C_k, dC_k+1> + <n_k, dn_k+1> (the chunk decay's
    gradient). The recursion over K3's q . dq sums gives the same G from the final states alone: the
    identity a K2 without those reads would rest on (docs/perf/mlstm.md, session 32)."""
    g0 = torch.Generator().manual_seed(7 * S + L)
    NH, DQK, DV = 2, 6, 5
    r = lambda *s: torch.randn(*s, generator=g0, dtype=torch.float64)  # noqa: E731
    q, k, v = (r(NH, S, d) for d in (DQK, DQK, DV))
    i, f = r(NH, S) * iscale, r(NH, S) + fshift
    c0, n0, m0 = r(NH, DQK, DV), r(NH, DQK), r(NH)
    got = emu(q, k, v, i, f, c0, n0, m0, eps, L, r(NH, S, DV), r(NH, DQK, DV), r(NH, DQK), r(NH))
    want, rec = got["g_states"], got["g_qdq"]
    assert want.shape == (NH, (S + L - 1) // L) and float(want.abs().max()) > 0
    assert float((rec - want).abs().max()) <= 1e-12 * float(want.abs().max()), (rec, want)
