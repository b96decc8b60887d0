import mmap, os, tempfile, time, threading, torch
from concurrent.futures import ThreadPoolExecutor
from isal import isal_zlib
path=tempfile.gettempdir()+"/ds-mmap-vs-pread.bin"
N=1<<30
if not os.path.exists(path):
    with open(path,"wb") as f:
        for i in range(64): f.write(os.urandom(16<<20))
with open(path,"rb") as f:
    while f.read(64<<20): pass
src=torch.empty(N//4); dst=torch.empty_like(src); dst.copy_(src)
pool=ThreadPoolExecutor(2)
def best(fn,reps=5):
    b=9e9
    for _ in range(reps):
        t=time.perf_counter(); fn(); b=min(b,time.perf_counter()-t)
    return b
def memcpy(): dst.copy_(src)
CH=1<<20
def pread_crc():
    fd=os.open(path,os.O_RDONLY)
    def part(lo,hi):
        buf=bytearray(CH); mv=memoryview(buf); c=0
        for o in range(lo,hi,CH):
            n=os.preadv(fd,[mv],o); c=isal_zlib.crc32(mv[:n],c)
        return c
    list(pool.map(lambda a: part(*a), [(0,N//2),(N//2,N)]))
    os.close(fd)
def mmap_crc(populate):
    fd=os.open(path,os.O_RDONLY)
    flags=mmap.MAP_SHARED|(mmap.MAP_POPULATE if populate else 0)
    m=mmap.mmap(fd,N,flags=flags,prot=mmap.PROT_READ)
    mv=memoryview(m)
    def part(lo,hi):
        c=0
        for o in range(lo,hi,8<<20):
            c=isal_zlib.crc32(mv[o:o+(8<<20)],c)
        return c
    list(pool.map(lambda a: part(*a), [(0,N//2),(N//2,N)]))
    mv.release(); m.close(); os.close(fd)
def mmap_crc_per_thread():
    fd=os.open(path,os.O_RDONLY)
    def part(lo,hi):
        m=mmap.mmap(fd,hi-lo,flags=mmap.MAP_SHARED|mmap.MAP_POPULATE,prot=mmap.PROT_READ,offset=lo)
        mv=memoryview(m); c=0
        for o in range(0,hi-lo,8<<20):
            c=isal_zlib.crc32(mv[o:o+(8<<20)],c)
        mv.release(); m.close(); return c
    list(pool.map(lambda a: part(*a), [(0,N//2),(N//2,N)]))
    os.close(fd)
def crc_mem():
    mv=memoryview(src.numpy()).cast("B")
    list(pool.map(lambda a: isal_zlib.crc32(mv[a[0]:a[1]]), [(0,N//2),(N//2,N)]))
for name,fn in [("memcpy",memcpy),("pread+crc",pread_crc),("mmap+crc",lambda: mmap_crc(False)),("mmap pop+crc",lambda: mmap_crc(True)),("mmap pop per thread",mmap_crc_per_thread),("crc in mem",crc_mem)]:
    t=best(fn); print(f"{name:20s} {t:.3f}s {N/t/1e9:.1f} GB/s")
import ctypes
def mmap_copy_crc(CHK):
    fd=os.open(path,os.O_RDONLY)
    m=mmap.mmap(fd,N,flags=mmap.MAP_SHARED,prot=mmap.PROT_READ)
    mv=memoryview(m)
    srcu=torch.frombuffer(m,dtype=torch.uint8)
    d=dst.view(torch.uint8); dmv=memoryview(d.numpy())
    def part(lo,hi):
        c=0
        for o in range(lo,hi,CHK):
            d[o:o+CHK].copy_(srcu[o:o+CHK])
            c=isal_zlib.crc32(dmv[o:o+CHK],c)
        return c
    torch.set_num_threads(1)
    list(pool.map(lambda a: part(*a), [(0,N//2),(N//2,N)]))
    del srcu; mv.release(); m.close(); os.close(fd)
def pread_into_crc(CHK):
    fd=os.open(path,os.O_RDONLY)
    d=dst.view(torch.uint8); dmv=memoryview(d.numpy())
    def part(lo,hi):
        c=0
        for o in range(lo,hi,CHK):
            n=os.preadv(fd,[dmv[o:o+CHK]],o); c=isal_zlib.crc32(dmv[o:o+CHK],c)
        return c
    list(pool.map(lambda a: part(*a), [(0,N//2),(N//2,N)]))
    os.close(fd)
for CHK in (256<<10, 1<<20, 8<<20):
    t=best(lambda: mmap_copy_crc(CHK)); print(f"mmap copy+crc {CHK>>10}K {t:.3f}s {N/t/1e9:.1f} GB/s")
    t=best(lambda: pread_into_crc(CHK)); print(f"pread into+crc {CHK>>10}K {t:.3f}s {N/t/1e9:.1f} GB/s")
t=best(memcpy); print("memcpy again", N/t/1e9)
