#!/usr/bin/env python3
"""The public surface, counted from rustdoc's HTML (redirect pages left out): items by kind, the
inherent methods of every public type, the root re-exports, the two builders' methods.

Usage: cargo doc --no-deps --all-features && python3 scripts/surface.py target/doc/axum_idempotency
"""
import sys,glob,re,os
d=sys.argv[1]
def real(f): 
    s=open(f).read(); return 'http-equiv="refresh"' not in s and 'Redirecting' not in s[:600]
kinds={}
for k in ["struct","enum","trait","type","fn","constant","macro"]:
    kinds[k]=[f for f in glob.glob(d+'/**/%s.*.html'%k,recursive=True) if real(f)]
    print("  %s: %d"%(k,len(kinds[k])))
def inherent(f):
    s=open(f).read()
    a=s.find('id="implementations-list"')
    if a<0: return set()
    ends=[x for x in (s.find('id="trait-implementations"',a),s.find('id="synthetic-implementations"',a),s.find('id="blanket-implementations"',a)) if x>0]
    b=min(ends or [len(s)])
    return set(re.findall(r'id="method\.([a-z_0-9]+)"',s[a:b]))
print("  inherent pub methods on all types:",sum(len(inherent(f)) for f in kinds["struct"]+kinds["enum"]))
idx=open(d+'/index.html').read()
print("  root re-exports:",len(set(re.findall(r'id="reexport\.([A-Za-z_0-9]+)"',idx))))
for t in ("IdempotencyLayer","Idempotent"):
    f=[x for x in kinds["struct"] if x.endswith('/struct.'+t+'.html')][0]
    m=sorted(inherent(f)); print("  %s inherent methods: %d: %s"%(t,len(m)," ".join(m)))
