# The gateway, installed the README's way. Build: docker build -t tap-upr-gateway .
# Run: docker run -p 11212:11212 -p 11213:11213 -p 9464:9464 tap-upr-gateway
#      (with no upstream it serves from its embedded reference node)
FROM python:3.11-slim
WORKDIR /opt/tap-upr-gateway
COPY pyproject.toml README.md ./
COPY adapters ./adapters
COPY gateway ./gateway
RUN pip install --no-cache-dir . && useradd --system --home-dir /var/lib/tap-upr-gateway gateway \
    && mkdir -p /var/lib/tap-upr-gateway && chown gateway /var/lib/tap-upr-gateway \
    && chmod 0700 /var/lib/tap-upr-gateway
USER gateway
VOLUME /var/lib/tap-upr-gateway
EXPOSE 11212 11213 9464
# Liveness from the metrics port; load balancers should route on /readyz (see README).
HEALTHCHECK --interval=30s --timeout=5s CMD ["python3", "-c", \
    "import urllib.request; urllib.request.urlopen('http://127.0.0.1:9464/healthz', timeout=4)"]
ENTRYPOINT ["tap-upr-gateway"]
CMD ["serve", "--state-dir", "/var/lib/tap-upr-gateway", "--tap-listen", "0.0.0.0:11212", \
     "--upr-listen", "0.0.0.0:11213", "--metrics-listen", "0.0.0.0:9464"]
