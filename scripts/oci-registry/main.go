// oci-registry serves an in-memory OCI distribution registry (go-containerregistry's) on one
// address until it is stopped: the registry `make release` pushes the chart to in the tests.
package main

import (
	"flag"
	"log"
	"net"
	"net/http"
	"time"

	"github.com/google/go-containerregistry/pkg/registry"
)

func main() {
	addr := flag.String("addr", "127.0.0.1:0", "address to listen on")
	flag.Parse()
	listener, err := net.Listen("tcp", *addr)
	if err != nil {
		log.Fatalf("listen %s: %v", *addr, err)
	}
	// The first line says where it listens, for whoever started it on port 0.
	log.SetFlags(0)
	log.Printf("listening on %s", listener.Addr())
	server := &http.Server{
		Handler:           registry.New(registry.Logger(log.New(log.Writer(), "", 0))),
		ReadHeaderTimeout: 10 * time.Second,
	}
	log.Fatal(server.Serve(listener))
}
