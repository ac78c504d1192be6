// The HTTP app of bench/drain.py: it subscribes to the routes it is given and answers
// every delivery 200 at once, so what is timed is daprd and the pub/sub, not the app.
//
//	drain-app PORT PUBSUB=TOPIC...
//
// Per route it counts arrivals, the first and last arrival (Unix ms), and the most
// deliveries it held at once (1 means daprd calls it one at a time on that route).
// GET /stats returns them as JSON.
package main

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"strings"
	"sync"
	"time"
)

type routeStats struct {
	Count     int64 `json:"count"`
	FirstMs   int64 `json:"first_ms"`
	LastMs    int64 `json:"last_ms"`
	InFlight  int64 `json:"-"`
	MaxAtOnce int64 `json:"max_at_once"`
	// Nanoseconds spent answering (request read to response written), summed.
	AnswerNs int64 `json:"answer_ns"`
	// Nanoseconds from an answer to the next request on the route while none was in flight,
	// summed, and how many such gaps: on a route daprd calls one at a time, the time per
	// message that is daprd's (and its pub/sub's), not the app's.
	GapNs  int64 `json:"gap_ns"`
	Gaps   int64 `json:"gaps"`
	lastAt time.Time
}

type subscription struct {
	PubsubName string `json:"pubsubname"`
	Topic      string `json:"topic"`
	Route      string `json:"route"`
}

var (
	mu    sync.Mutex
	stats = map[string]*routeStats{}
	subs  []subscription
)

func event(w http.ResponseWriter, r *http.Request) {
	start := time.Now()
	mu.Lock()
	s := stats[r.URL.Path]
	if s == nil {
		s = &routeStats{}
		stats[r.URL.Path] = s
	}
	if s.InFlight == 0 && !s.lastAt.IsZero() {
		s.GapNs += start.Sub(s.lastAt).Nanoseconds()
		s.Gaps++
	}
	// Held from the request's start to its answer: more than 1 at once means daprd
	// called this route concurrently.
	s.InFlight++
	if s.InFlight > s.MaxAtOnce {
		s.MaxAtOnce = s.InFlight
	}
	mu.Unlock()
	// Read the body as any app would.
	_, _ = io.Copy(io.Discard, r.Body)
	w.Header().Set("Content-Type", "application/json")
	_, _ = w.Write([]byte(`{"status":"SUCCESS"}`))
	end := time.Now()
	now := end.UnixMilli()
	mu.Lock()
	if s.Count == 0 {
		s.FirstMs = now
	}
	s.Count++
	s.LastMs = now
	s.AnswerNs += end.Sub(start).Nanoseconds()
	s.InFlight--
	s.lastAt = end
	mu.Unlock()
}

func writeJSON(w http.ResponseWriter, v any) {
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(v)
}

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: drain-app PORT PUBSUB=TOPIC...")
		os.Exit(2)
	}
	for _, spec := range os.Args[2:] {
		pubsub, topic, ok := strings.Cut(spec, "=")
		if !ok {
			fmt.Fprintf(os.Stderr, "bad subscription %q (PUBSUB=TOPIC)\n", spec)
			os.Exit(2)
		}
		subs = append(subs, subscription{pubsub, topic, "/events/" + pubsub + "/" + topic})
	}
	mux := http.NewServeMux()
	mux.HandleFunc("/events/", event)
	mux.HandleFunc("/dapr/subscribe", func(w http.ResponseWriter, _ *http.Request) { writeJSON(w, subs) })
	mux.HandleFunc("/dapr/config", func(w http.ResponseWriter, _ *http.Request) { writeJSON(w, map[string]any{}) })
	mux.HandleFunc("/healthz", func(w http.ResponseWriter, _ *http.Request) { writeJSON(w, map[string]bool{"ok": true}) })
	mux.HandleFunc("/stats", func(w http.ResponseWriter, _ *http.Request) {
		mu.Lock()
		defer mu.Unlock()
		writeJSON(w, stats)
	})
	server := &http.Server{Addr: "127.0.0.1:" + os.Args[1], Handler: mux}
	if err := server.ListenAndServe(); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}
