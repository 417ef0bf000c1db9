# moe-serve images. GPU (default):  docker build -t moe-serve .
#                   CPU engine:     docker build --target cpu -t moe-serve:cpu .
# Run (8x H200): docker run --gpus all --ipc=host -p 8000:8000 -v /models:/models \
#   -e MOE_SERVE_MODEL=/models/Mixtral-8x7B -e MOE_SERVE_TENSOR_PARALLEL_SIZE=8 moe-serve

# ---- CPU target: vLLM CPU engine, the embedded tiny model by default --------------------
FROM python:3.11-slim AS cpu
ENV PYTHONUNBUFFERED=1 MOE_SERVE_HOST=0.0.0.0 MOE_SERVE_PORT=8000 MOE_SERVE_CACHE=/var/cache/moe-serve
WORKDIR /app
COPY pyproject.toml README.md LICENSE ./
COPY service ./service
COPY kernels ./kernels
COPY loadtest ./loadtest
COPY bench ./bench
RUN pip install --no-cache-dir ".[cpu]" \
 && pip uninstall -y torchvision torchaudio torchcodec || true
# Build the embedded model at image build time so the container starts without it.
RUN python -m moe_serve.service.embedded_model
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=3s --start-period=120s CMD python -c "import urllib.request,sys; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/health').status != 200)"
ENTRYPOINT ["moe-serve"]

# ---- GPU target: vLLM 0.26.0 (CUDA) + moe-serve's Triton MoE kernels --------------------
FROM vllm/vllm-openai:v0.26.0 AS gpu
ENV PYTHONUNBUFFERED=1 MOE_SERVE_HOST=0.0.0.0 MOE_SERVE_PORT=8000 MOE_SERVE_CACHE=/var/cache/moe-serve \
    VLLM_WORKER_MULTIPROC_METHOD=spawn
WORKDIR /app
COPY pyproject.toml README.md LICENSE ./
COPY service ./service
COPY kernels ./kernels
COPY loadtest ./loadtest
COPY bench ./bench
# vLLM (and torch, triton) come from the base image: install only our own pins on top.
RUN pip install --no-cache-dir ".[gpu]"
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=3s --start-period=600s CMD python3 -c "import urllib.request,sys; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/health').status != 200)"
ENTRYPOINT ["moe-serve"]
