# Sourced by the GPU runbooks (deploy/gpu_session.sh, deploy/gpu_smollm2.sh): installs the carried wheels
# into /tmp/site (once per machine: a later call on the warm machine finds them) and makes the package
# importable without a build step by linking the top-level folders under /tmp/pkg/slipstream, as
# pyproject maps them.
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
mkdir -p /tmp/pkg/slipstream
for d in runtime rl actors protocols engine deploy benchmarks cli tasks; do
  ln -sfn "$PWD/$d" "/tmp/pkg/slipstream/$d"
done
export PYTHONPATH="/tmp/site:/tmp/pkg${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
