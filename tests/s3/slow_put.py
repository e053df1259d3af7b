"""A SigV4-signed PUT whose body is sent in two halves, for the drain test.

usage: slow_put.py ENDPOINT ACCESS_KEY SECRET BUCKET KEY TOKEN BODY

Sends the request line, the headers and the first half of BODY, prints "half-sent", then
waits for a line on stdin before it sends the rest; prints the response as JSON
{"status": 200, "body": "..."}. The test decides when the request completes: no sleeps.
"""
import hashlib
import json
import socket
import sys
from urllib.parse import urlparse

from botocore.auth import S3SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials

endpoint, key_id, secret, bucket, key, token, body = sys.argv[1:8]
body = body.encode()
url = urlparse(endpoint)
host = url.netloc
request = AWSRequest(
    method="PUT",
    url=f"{endpoint}/{bucket}/{key}",
    data=body,
    headers={
        "Host": host,
        "Fencing-Token": token,
        "x-amz-content-sha256": hashlib.sha256(body).hexdigest(),
    },
)
S3SigV4Auth(Credentials(key_id, secret), "s3", "us-east-1").add_auth(request)
head = f"PUT /{bucket}/{key} HTTP/1.1\r\n"
for name, value in request.headers.items():
    head += f"{name}: {value}\r\n"
head += f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
half = len(body) // 2
sock = socket.create_connection((url.hostname, url.port), timeout=60)
sock.sendall(head.encode() + body[:half])
print("half-sent", flush=True)
sys.stdin.readline()
sock.sendall(body[half:])
response = b""
while True:
    chunk = sock.recv(65536)
    if not chunk:
        break
    response += chunk
head, _, rest = response.partition(b"\r\n\r\n")
status = int(head.split(b" ", 2)[1]) if head else 0
print(json.dumps({"status": status, "body": rest.decode(errors="replace")}), flush=True)
