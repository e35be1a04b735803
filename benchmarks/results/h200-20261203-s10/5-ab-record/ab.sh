set -u
S="python3 -m treeflash.cli bench sweep --preset kimi-k2-tp8 --device cuda --dtype bfloat16 --tree-budget 31 --max-tokens 160 --acceptance oracle --page-size 64 --cuda-graphs --no-progress"
C="--spec ddtree --contexts 1k,64k,256k"
for r in 1 2; do
  PYTHONPATH=$PWD/ab_old/src timeout 90 $S $C --out $OUT/old-$r.json > $OUT/old-$r.log 2>&1; echo old-$r rc=$?
  TREEFLASH_OVERLAP=0 PYTHONPATH=$PWD/src timeout 90 $S $C --out $OUT/new-$r.json > $OUT/new-$r.log 2>&1; echo new-$r rc=$?
  TREEFLASH_OVERLAP=0 TREEFLASH_TREE_INTO_VERIFY=0 PYTHONPATH=$PWD/src timeout 90 $S $C --out $OUT/newcopy-$r.json > $OUT/newcopy-$r.log 2>&1; echo newcopy-$r rc=$?
done
for f in old-1 new-1 newcopy-1 old-2 new-2 newcopy-2; do echo "== $f"; grep -h "ddtree:\|slope ddtree" $OUT/$f.log; done
PYTHONPATH=$PWD/src timeout 150 $S --spec off,dflash,ddtree --contexts 1k,8k,32k,64k,128k,185k,256k --out $OUT/record.json --plot $OUT/record.png > $OUT/record.log 2>&1; echo record rc=$?
grep -h "ddtree:\|slope" $OUT/record.log
