#!/usr/bin/env python3
"""A unix-socket proxy that records every byte its clients send.

    record-proxy.py LISTEN TARGET LOG

Listens on LISTEN (TARGET in the same directory); each connection is joined to a new connection to TARGET, both ways; what
the clients send is appended to LOG (one file for all connections, in arrival order). The
tests put it where a launcher's control socket is, so that everything virt-handler sends a Pod
can be searched for what must never be in it. File descriptors passed with SCM_RIGHTS are not
carried: use it only where none are sent.
"""
import os
import socket
import sys
import threading

listen, target, log = (os.path.abspath(a) for a in sys.argv[1:4])
lock = threading.Lock()
# A socket path is limited to 107 bytes and a Pod's can be longer: bind and connect by name
# from the socket's directory (LISTEN and TARGET share it).
os.chdir(os.path.dirname(listen))
listen, target = os.path.basename(listen), os.path.relpath(target)


def pump(src, dst, record):
    try:
        while True:
            data = src.recv(65536)
            if not data:
                break
            if record:
                with lock, open(log, "ab") as f:
                    f.write(data)
            dst.sendall(data)
    except OSError:
        pass
    for s in (dst, src):
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


try:
    os.unlink(listen)
except FileNotFoundError:
    pass
server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
server.bind(listen)
server.listen(16)
open(log, "ab").close()
while True:
    client, _ = server.accept()
    upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        upstream.connect(target)
    except OSError:
        client.close()
        continue
    threading.Thread(target=pump, args=(client, upstream, True), daemon=True).start()
    threading.Thread(target=pump, args=(upstream, client, False), daemon=True).start()
